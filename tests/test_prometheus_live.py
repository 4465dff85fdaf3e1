"""A real Prometheus scraping a live tiny-model `sparrow train` (issue 13: monitoring that works live).

The job runs in this process (`TrainingJob`: coordinator, 1 rollout worker, 2 DeepSpeed ranks on a
local Ray); Prometheus (the `prometheus` binary: Debian's package, which `bash deploy/setup.sh --test`
installs as root) runs the shipped deploy/prometheus.yml and deploy/prometheus-rules.yml with a 1 s
scrape and evaluation interval, its scrape job reading the run's file_sd file
RUN_DIR/prometheus_targets.json. τ is set above what the tiny model reaches, so bins are below τ: the
situation in which the old alert failed live ("many-to-many matching not allowed").

Then, through Prometheus' HTTP API, with the job still up:
- every target of the file_sd list (coordinator, rollout-0, trainer-0, trainer-1) is up, with its labels;
- every query of deploy/grafana/sparrow.json (panels, the annotation; $run and $bin substituted) and the
  template variables' label_values evaluate without error, the key ones (KEY_PANELS) return data, and
  within each panel no two series get the same legend;
- every alert rule's expression evaluates, every rule Prometheus evaluates itself reports health "ok",
  and SparrowTailBelowTarget's expression returns the bins below τ;
- the values match the run: steps completed, τ, the tail per bin, the schedule versions of coordinator
  and worker.
When the job closes, its file_sd list is emptied.
"""

import json
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from jobs import tiny_job

ray = pytest.importorskip("ray")

from sparrow.coordinator.config import load_config  # noqa: E402
from sparrow.coordinator.driver import TrainingJob  # noqa: E402
from sparrow.coordinator.run_dir import RunDir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = shutil.which("prometheus")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="no `prometheus` binary on PATH: `bash deploy/setup.sh --test` installs "
                       "Debian's prometheus package when run as root with apt-get (it prints why when it cannot)"),
]

TAU = 0.98
STEPS = 3
RUN = "live"
SETTINGS = {
    "rollout.sampling": {"max_tokens": 20, "n": 4, "temperature": 1.0}, "rollout.speedup_probe_every": 1,
    "rollout.schedule.topk_blocks": [1, 1, 1], "trainer.pool.size": 2, "controller.target": TAU,
    "metrics": {"port": 0}, "run.steps": STEPS, "trainer.exact_alpha": True,
}

# Panels (title, refId) that must return data from a live CPU run. The rest must evaluate; they may be
# empty here (GPU memory on CPU ranks, recoveries, reward errors, skipped updates' series exist but
# are 0, backpressure waits ...).
KEY_PANELS = [
    ("Tail α (p5) per bin vs τ", "A"), ("Tail α (p5) per bin vs τ", "B"), ("Tail α (p5) per bin vs τ", "C"),
    ("KV budget per bin (blocks attended)", "A"),
    ("α distribution (cumulative histogram, 10 m rate)", "A"),
    ("Schedule version per process", "A"),
    ("KV reads, sparse over dense (last step)", "A"),
    ("Rollout tokens per second", "A"), ("Rollout tokens per second", "C"),
    ("Rollout utilisation per worker (last step)", "A"),
    ("Rollout batch: busy-batch fraction and tail share (last step)", "A"),
    ("Rollout batch: busy-batch fraction and tail share (last step)", "B"),
    ("Rollout speedup: measured vs predicted", "A"), ("Rollout speedup: measured vs predicted", "B"),
    ("Mean reward (5 m)", "A"),
    ("Policy version per worker", "A"),
    ("Training steps completed", "A"),
    ("Trainer tokens per second per rank", "A"),
    ("Trainer step seconds per rank", "A"),
    ("Policy-gradient loss (last step)", "A"),
    ("Host memory per rank (RSS)", "A"),
    ("Weight publication seconds (p50 / p99, 30 m)", "A"),
    ("Queue depth vs capacity", "A"),
    ("Processes up", "A"),
]
PROCESSES = {"coordinator": "coordinator", "rollout-0": "rollout", "trainer-0": "trainer", "trainer-1": "trainer"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    """The prometheus binary on the shipped configuration, rewritten for a 1 s interval and one run's file."""

    def __init__(self, tmp: Path, targets_file: Path):
        shipped = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
        config = dict(shipped)
        config["global"] = {**shipped["global"], "scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(ROOT / "deploy" / r) for r in shipped["rule_files"]]
        (job,) = shipped["scrape_configs"]
        assert job["honor_labels"] is True and "static_configs" not in job
        job["file_sd_configs"] = [{**job["file_sd_configs"][0], "files": [str(targets_file)], "refresh_interval": "1s"}]
        config["scrape_configs"] = [job]
        path = tmp / "prometheus.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = (tmp / "prometheus.log").open("w")
        self.process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={path}", f"--storage.tsdb.path={tmp / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/-/ready", timeout=2).read()
                return
            except (urllib.error.URLError, ConnectionError):
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.close()
                    raise RuntimeError(f"prometheus did not start: {(tmp / 'prometheus.log').read_text()[-2000:]}")
                time.sleep(0.2)

    def api(self, endpoint: str, **params) -> dict:
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{endpoint}?{query}", timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:  # a PromQL error comes back as 400/422 with a JSON body
            return json.loads(e.read())

    def query(self, expr: str) -> list[dict]:
        reply = self.api("query", query=expr)
        assert reply["status"] == "success", f"{expr}: {reply.get('errorType')}: {reply.get('error')}"
        return reply["data"]["result"]

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def value(series: dict) -> float:
    return float(series["value"][1])


def by(label: str, result: list[dict]) -> dict[str, float]:
    return {s["metric"].get(label, ""): value(s) for s in result}


def legend(fmt: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m[1], ""), fmt)


def substitute(expr: str) -> str:
    return expr.replace("$run", RUN).replace("$bin", ".*")


def wait_for(prom: Prometheus, expr: str, check, timeout: float = 90.0) -> list[dict]:
    """Poll until `check` holds (a busy 2-core CI machine can take many scrape intervals), then the last result."""
    deadline = time.monotonic() + timeout
    while True:
        result = prom.query(expr)
        if check(result) or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def test_live_prometheus_scrapes_a_run_and_evaluates_every_dashboard_query_and_rule(ray_cluster, tiny_qwen3, tmp_path):
    started = time.monotonic()
    job_file = tiny_job(tmp_path / "job.yaml", tiny_qwen3, tmp_path / "runs", SETTINGS)
    config = load_config(job_file)
    run_dir = RunDir.create(config.run.out_dir, RUN)
    prom = Prometheus(tmp_path, run_dir.prometheus_targets_file)
    board = json.loads((ROOT / "deploy" / "grafana" / "sparrow.json").read_text())
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus-rules.yml").read_text())
    try:
        with TrainingJob(config, run_dir, progress=False, log=lambda *_: None) as job:
            listed = json.loads(run_dir.prometheus_targets_file.read_text())
            assert {g["labels"]["worker"]: g["labels"]["role"] for g in listed} == PROCESSES
            assert all(g["labels"]["run"] == RUN for g in listed)
            # Prometheus' discovery passes file changes on every 5 s: wait until it scrapes every process.
            up = wait_for(prom, f'up{{run="{RUN}"}}', lambda r: len(r) == 4 and all(value(s) == 1 for s in r))
            assert by("worker", up) == dict.fromkeys(PROCESSES, 1.0), prom.api("targets")
            records = job.run()
            ended = time.time()
            last = records[-1]

            # Prometheus has scraped the end state at least twice (rate() needs two samples), and every process
            # after the job ended, so each gauge holds its last value (a trainer rank's loss of the last step).
            for series in ("sparrow_train_step", "sparrow_rollout_tokens_total", "sparrow_train_step_seconds"):
                wait_for(prom, f'min(count_over_time({series}{{run="{RUN}"}}[1m])) >= 2 and on() '
                         f'(sparrow_train_step{{run="{RUN}"}} == {STEPS})', bool)
            scraped = wait_for(prom, f'timestamp(up{{run="{RUN}"}})',
                               lambda r: len(r) == 4 and all(value(s) > ended for s in r))
            assert all(value(s) > ended for s in scraped), f"not every process was scraped after the job ended: {scraped}"

            targets = prom.api("targets")["data"]["activeTargets"]
            assert {t["labels"]["worker"]: t["labels"]["role"] for t in targets} == PROCESSES
            assert all(t["health"] == "up" and t["labels"]["run"] == RUN for t in targets)

            # Every dashboard query evaluates; the key ones return data; legends are unique per panel.
            empty = []
            for panel in board["panels"]:
                legends = []
                for target in panel.get("targets", []):
                    result = prom.query(substitute(target["expr"]))
                    if (panel["title"], target["refId"]) in KEY_PANELS:
                        assert result, f"{panel['title']} {target['refId']}: no data for {target['expr']}"
                    elif not result:
                        empty.append(f"{panel['title']} {target['refId']}")
                    legends += [legend(target["legendFormat"], s["metric"]) for s in result]
                assert len(legends) == len(set(legends)), f"{panel['title']}: ambiguous legends {sorted(legends)}"
            for annotation in board["annotations"]["list"]:
                prom.query(substitute(annotation["expr"]))
            for variable in board["templating"]["list"]:
                if variable["type"] != "query":
                    continue
                metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["definition"]).groups()
                reply = prom.api("series", **{"match[]": substitute(metric)})
                assert reply["status"] == "success" and {s.get(label) for s in reply["data"]} - {None}, variable["name"]
            assert set(empty) <= {
                "GPU memory per rank A", "Recoveries by kind (1 h) A", "Recovery seconds (p90 by kind, 1 h) A",
                "Reward function errors by reason (15 m) A", "Controller changes by reason (15 m) A",
                "Backpressure waits (1 m rate) A",
                # data.eval is off in this job:
                "Held-out accuracy by decoding mode A", "Held-out accuracy by decoding mode B", "Evaluated policy version A",
            }, empty

            # Every alert expression evaluates, and Prometheus' own evaluations of the rules are healthy.
            for rule in rules["groups"][0]["rules"]:
                prom.query(rule["expr"])
            below = prom.query(next(r["expr"] for r in rules["groups"][0]["rules"] if r["alert"] == "SparrowTailBelowTarget"))
            assert below and all(value(s) < TAU and s["metric"]["worker"] == "coordinator" for s in below)
            evaluated = [r for g in prom.api("rules")["data"]["groups"] for r in g["rules"]]
            assert len(evaluated) == len(rules["groups"][0]["rules"])
            assert all(r["health"] == "ok" for r in evaluated), [(r["name"], r.get("lastError")) for r in evaluated]

            # The values are the run's.
            assert by("worker", prom.query(f'sparrow_alpha_target{{run="{RUN}"}}')) == {"coordinator": TAU}
            latest = {}  # the tail gauge holds each bin's value from the last step that measured it
            for record in records:
                for b, p5 in enumerate(record.alpha.p5):
                    if p5 is not None:
                        latest[str(b)] = p5
            tail = by("bin", prom.query(f'sparrow_alpha_tail{{run="{RUN}",quantile="0.05"}}'))
            assert tail == pytest.approx(latest)
            assert set(by("bin", below)) == {b for b, v in latest.items() if v < TAU}
            versions = by("worker", prom.query(f'sparrow_schedule_version{{run="{RUN}"}}'))
            assert versions == {"coordinator": last.schedule.version, "rollout-0": max(last.rollout.schedule_versions)}
            assert versions["rollout-0"] > 0, "the worker reports the schedules it applies"
            trainers = by("worker", prom.query(f'sparrow_train_loss{{run="{RUN}"}}'))
            # each rank reports the all-reduced loss; with rewards equal within every group it is ~1e-8, where
            # the ranks' summation order alone differs by 50 %: compare absolutely
            assert trainers == pytest.approx(dict.fromkeys(["trainer-0", "trainer-1"], last.train["train/pg_loss"]),
                                             rel=1e-5, abs=1e-6)
            queues = prom.query(f'sparrow_queue_capacity{{run="{RUN}"}}')
            assert {s["metric"]["queue"]: s["metric"]["worker"] for s in queues} == {"trajectory": "trainer-0"}
            measured = by("worker", prom.query(f'sparrow_speedup_measured{{run="{RUN}"}}'))
            assert measured == pytest.approx({"coordinator": next(r.rollout.speedup_measured for r in reversed(records)
                                                                  if r.rollout.speedup_measured is not None)})
        assert json.loads(run_dir.prometheus_targets_file.read_text()) == [], "a finished run lists no processes"
    finally:
        prom.close()
    print(f"live Prometheus test: {time.monotonic() - started:.1f} s")
