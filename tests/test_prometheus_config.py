"""The file_sd scrape targets a run writes, and the shipped Prometheus files checked by promtool: the
configuration and rules are valid, and deploy/prometheus-rules.test.yml makes every alert fire and
resolve on synthetic series (promtool test rules). The promtool parts skip with a reason when promtool
is absent (`bash deploy/setup.sh --test` installs Debian's prometheus package, which ships it)."""

import json
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import yaml

from sparrow.coordinator.metrics import TARGETS_FILE, MetricsConfig, ScrapeTargets, file_sd_groups, target_labels, write_file_sd
from sparrow.coordinator.run_dir import RunDir

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="no `promtool` on PATH: `bash deploy/setup.sh --test` installs Debian's prometheus package "
    "(which ships promtool) when run as root with apt-get"
)


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=DEPLOY, capture_output=True, text=True, timeout=120)


# ---------------------------------------------------------------------------------------- file_sd


def test_file_sd_groups_one_group_per_endpoint_sorted_with_path_and_scheme():
    groups = file_sd_groups([
        ("http://10.0.0.2:9401/metrics", target_labels("rollout", "rollout-0", "r1")),
        ("http://10.0.0.1:9400/metrics", target_labels("coordinator", "coordinator", "r1")),
        ("https://[fd00::3]:9402/custom", target_labels("trainer", "trainer-0", "r1")),
        ("http://10.0.0.4:9401", {"role": "trainer", "worker": "trainer-1", "run": "r1"}),
    ])
    assert groups == [
        {"targets": ["10.0.0.1:9400"], "labels": {"role": "coordinator", "worker": "coordinator", "run": "r1"}},
        {"targets": ["10.0.0.2:9401"], "labels": {"role": "rollout", "worker": "rollout-0", "run": "r1"}},
        {"targets": ["10.0.0.4:9401"], "labels": {"role": "trainer", "worker": "trainer-1", "run": "r1"}},
        {"targets": ["[fd00::3]:9402"], "labels": {"role": "trainer", "worker": "trainer-0", "run": "r1",
                                                    "__metrics_path__": "/custom", "__scheme__": "https"}},
    ]
    assert file_sd_groups([]) == []


@pytest.mark.parametrize("url, labels, message", [
    ("10.0.0.1:9400", {}, "http"),
    ("http://10.0.0.1/metrics", {}, "host:port"),
    ("http://10.0.0.1:99999/metrics", {}, "host:port"),
    ("http://10.0.0.1:9400/metrics", {"bad-name": "x"}, "not valid Prometheus label names"),
    ("http://10.0.0.1:9400/metrics", {"__address__": "x"}, "reserved"),
])
def test_file_sd_groups_rejects_what_prometheus_would(url, labels, message):
    with pytest.raises(ValueError, match=message):
        file_sd_groups([(url, labels)])
    with pytest.raises(ValueError, match="listed twice"):
        file_sd_groups([("http://h:1/metrics", {}), ("http://h:1/metrics", {})])
    with pytest.raises(ValueError, match="one of coordinator, rollout, trainer"):
        target_labels("observer", "o", "r1")


def test_write_file_sd_replaces_the_file_atomically(tmp_path):
    path = tmp_path / "sd" / "targets.json"
    write_file_sd(path, [("http://10.0.0.1:9400/metrics", {"role": "coordinator"})])
    first = json.loads(path.read_text())
    assert first[0]["targets"] == ["10.0.0.1:9400"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o644, "readable by a Prometheus running as its own user"
    with pytest.raises(ValueError):
        write_file_sd(path, [("no-port", {})])
    assert json.loads(path.read_text()) == first, "a failed update leaves the previous list"
    assert os.listdir(path.parent) == ["targets.json"], "no temporary file left behind"


def test_scrape_targets_follow_membership_in_every_file(tmp_path):
    run_dir = RunDir.create(tmp_path / "runs", "r7")
    shared = tmp_path / "sparrow-targets"
    targets = ScrapeTargets.for_run(run_dir, MetricsConfig(file_sd_dir=str(shared)))
    files = [run_dir.prometheus_targets_file, shared / "r7.json"]
    assert run_dir.prometheus_targets_file.name == TARGETS_FILE
    assert all(json.loads(f.read_text()) == [] for f in files), "written (empty) at once"

    def listed():
        contents = [json.loads(f.read_text()) for f in files]
        assert contents[0] == contents[1] == targets.content()
        return {g["labels"]["worker"]: (g["labels"]["role"], g["targets"][0]) for g in contents[0]}

    targets.set("coordinator", "coordinator", "http://10.0.0.1:9400/metrics")
    targets.set("rollout-0", "rollout", "http://10.0.0.2:9401/metrics")
    targets.set("trainer-0", "trainer", "http://10.0.0.3:9401/metrics")
    targets.set("trainer-1", "trainer", None)  # metrics off on that rank
    assert listed() == {"coordinator": ("coordinator", "10.0.0.1:9400"), "rollout-0": ("rollout", "10.0.0.2:9401"),
                        "trainer-0": ("trainer", "10.0.0.3:9401")}
    assert all(g["labels"]["run"] == "r7" for g in targets.content())
    targets.set("rollout-0", "rollout", "http://10.0.0.5:9401/metrics")  # replaced on another node
    targets.remove("trainer-0")
    assert listed() == {"coordinator": ("coordinator", "10.0.0.1:9400"), "rollout-0": ("rollout", "10.0.0.5:9401")}
    with pytest.raises(ValueError, match="one of coordinator"):
        targets.set("x", "observer", "http://h:1/metrics")
    targets.clear()
    assert listed() == {}


# ---------------------------------------------------------------------------------------- promtool


@needs_promtool
def test_promtool_accepts_the_configuration_and_rules():
    config = promtool("check", "config", "prometheus.yml")
    assert config.returncode == 0, config.stdout + config.stderr
    assert "SUCCESS: 1 rule files found" in config.stdout + config.stderr
    rules = promtool("check", "rules", "prometheus-rules.yml")
    assert rules.returncode == 0, rules.stdout + rules.stderr


@needs_promtool
def test_promtool_rule_unit_tests_pass():
    result = promtool("test", "rules", "prometheus-rules.test.yml")
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_every_alert_has_a_unit_test_that_fires_and_then_resolves():
    """Static check of deploy/prometheus-rules.test.yml (runs without promtool too)."""
    rules = yaml.safe_load((DEPLOY / "prometheus-rules.yml").read_text())
    alerts = [r["alert"] for g in rules["groups"] for r in g["rules"]]
    tests = yaml.safe_load((DEPLOY / "prometheus-rules.test.yml").read_text())
    assert tests["rule_files"] == ["prometheus-rules.yml"]

    def minutes(t: str) -> int:
        return int(t.removesuffix("m"))

    for alert in alerts:
        covered = False
        for test in tests["tests"]:
            cases = sorted((minutes(c["eval_time"]), bool(c["exp_alerts"])) for c in test["alert_rule_test"]
                           if c["alertname"] == alert)
            fired = [t for t, firing in cases if firing]
            covered |= bool(fired) and any(not firing and t > fired[0] for t, firing in cases) \
                and any(not firing and t < fired[0] for t, firing in cases)
        assert covered, f"{alert}: no unit test sees it quiet, firing, then resolved"


def test_kubernetes_job_gives_the_labels_the_dashboard_and_rules_use():
    """Debian's promtool has no Kubernetes discovery and rejects this file, so check its relabelling here."""
    config = yaml.safe_load((DEPLOY / "prometheus-kubernetes.yml").read_text())
    (job,) = config["scrape_configs"]
    targets = {r.get("target_label") for r in job["relabel_configs"]}
    assert {"role", "run"} <= targets
    assert config["rule_files"] == ["prometheus-rules.yml"]
