"""Chaos soak (issue 44 item 10): a real `sparrow train` job under a seeded fault injector, then an audit.

    python -m sparrow.bench.chaos_soak --minutes 30 --seed 0 --out OUT [--model DIR] [--interval 120 300]

The job is `sparrow train` in a subprocess (what users run, signals and all): the tiny Qwen3 model on the CPU,
2 rollout workers, 1 trainer rank, async mode, a checkpoint every step, leases that expire after
`--lease-timeout-s` and a probe that gives a silent worker `--hung-worker-timeout-s`, so a loss or a stall is
noticed well within a minute. From the job's first step, every `--interval` seconds (uniform within, from
`random.Random(--seed)`; never before the previous fault was resolved) the injector does one of `--faults`:

    kill-rollout    SIGKILL a rollout worker's process (which one: drawn)
    kill-trainer    SIGKILL the trainer rank's process
    stall-rollout   SIGSTOP a rollout worker's process for `--stall-s` (longer than the lease), then SIGCONT
    stall-trainer   the same to the trainer rank

It finds a process from the run's scrape targets (RUN_DIR/prometheus_targets.json: worker id -> its /metrics
port) and the process listening on that port, checked to be that Ray actor (`ray::RolloutWorker`,
`ray::TrainerHost`). A fault is resolved when the job recorded the recovery from a kill (events.jsonl: the
killed worker's `rollout_worker_lost`, or `trainer_lost`, with its recovery time), or when a step completed
after a stalled process was continued (a stalled rollout worker's slot, or its replacement, contributing groups).
Meanwhile it scrapes the coordinator's /metrics every `--scrape-s`. After `--minutes` it stops the job with
SIGINT (the job finishes its step, checkpoints and exits 130) and reports: steps completed, faults injected
by kind with their times, the job's recoveries and their times, samples trained, lost and duplicated
(RUN_DIR/ledger.jsonl against the prompts dispatched) and whether every coordinator metric series stayed
continuous (defined in `chaos_audit.py`). OUT gets soak.json, the job's config and its timestamped log.
Exit status 0 when nothing was lost or duplicated, every fault was resolved, the series stayed continuous and
the job stopped cleanly; 1 otherwise.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import yaml

from sparrow.bench.chaos_audit import (Fault, audit_ledger, check_continuity, expected_ids, resolving_event,
                                       resolving_step)
from sparrow.bench.chaos_watch import Watch, lines, scrape_targets, worker_pid
from sparrow.bench.train_runs import interrupt, train_command
from sparrow.coordinator.config import load_config

FAULT_KINDS = ("kill-rollout", "kill-trainer", "stall-rollout", "stall-trainer")
SIGINT_EXIT = 128 + signal.SIGINT


def soak_job(model: Path, run_root: Path, args) -> dict:
    """The tiny job (tests/jobs.py's shape) with 2 workers, async, a checkpoint every step and fast recovery."""
    return {
        "model": str(model),
        "data": {"arithmetic": {"min_value": 0, "max_value": 1, "operations": ["+"]}},
        "rollout": {"pool": {"size": 2, "cpus": 0.5},
                    "native": {"max_num_seqs": 8, "max_model_len": 256, "num_kv_blocks": 256},
                    "sampling": {"max_tokens": 16, "n": 2, "temperature": 1.0},
                    "schedule": {"name": "tiny", "edges": [80, 96], "topk_blocks": [2, 2, 3]}},
        "trainer": {"pool": {"size": 1, "cpus": 0.5}, "optimizer": {"lr": 1.0e-3}, "micro_batch_tokens": 512,
                    "recompute_topk": 8},
        "controller": {"ladder": [1, 2, 3, 4, 6, 8], "min_samples": 20, "window_steps": 1},
        "metrics": {"port": 0},
        "run": {"name": "run", "out_dir": str(run_root), "steps": 1_000_000, "prompts_per_step": 8, "mode": "async",
                "checkpoint_every": 1, "keep_checkpoints": 1,
                "recovery": {"lease_timeout_s": args.lease_timeout_s,
                             "hung_worker_timeout_s": args.hung_worker_timeout_s, "join_timeout_s": 300.0,
                             "max_worker_restarts": 1000, "max_trainer_restarts": 1000}},
    }


def tiny_model(path: Path) -> Path:
    """The tiny random Qwen3 the tests use (`build_tiny_checkpoint`, seed 0), built once."""
    if not (path / "model.safetensors").exists():
        from sparrow.model_zoo import build_tiny_checkpoint

        build_tiny_checkpoint(path, family="qwen3", seed=0)
    return path


# ---------------------------------------------------------------------- injecting

def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:  # already gone (a stalled worker the job killed and replaced)
        return False


def resolved(watch: Watch, fault: Fault, resumed_at: float) -> tuple[float, dict] | None:
    events, records = watch.snapshot()
    if fault.kind.startswith("kill"):
        return resolving_event(fault, events)
    return resolving_step(fault, records, resumed_at)


def whole(watch: Watch, workers: int, timeout_s: float) -> bool:
    """Wait until the run's scrape targets list `workers` serving rollout workers and the trainer rank (a replacement
    is listed once it serves), so that each fault meets a whole job."""
    deadline = time.monotonic() + timeout_s
    while watch.proc.poll() is None and time.monotonic() < deadline:
        roles = Counter(role for role, _ in scrape_targets(watch.run_dir).values())
        if roles["rollout"] == workers and roles["trainer"] >= 1:
            return True
        time.sleep(1.0)
    return False


def inject(watch: Watch, rng: random.Random, args, workers: int, log) -> Fault | None:
    """One fault, drawn from `rng`, on the whole job; waits until it is resolved (at most `--settle-s`). None: the job
    did not become whole again (or ended) within `--settle-s`."""
    kind = rng.choice(args.faults)
    draw = rng.random()
    if not whole(watch, workers, args.settle_s):
        log(f"{watch.now():7.1f} s  {kind}: the job has not had {workers} serving rollout workers and its trainer "
            f"for {args.settle_s:.0f} s; no more faults")
        return None
    rollout = sorted(w for w, (role, _) in scrape_targets(watch.run_dir).items() if role == "rollout")
    target = "trainer-0" if kind.endswith("trainer") else rollout[int(draw * len(rollout))]
    pid = worker_pid(watch.run_dir, target)
    if pid is None:
        log(f"{watch.now():7.1f} s  {kind}: no process of {target} listens on its /metrics port; no more faults")
        return None
    fault = Fault(kind, target, pid, watch.now(), watch.train_step(),
                  args.stall_s if kind.startswith("stall") else None)
    stall = kind.startswith("stall")
    _signal(pid, signal.SIGSTOP if stall else signal.SIGKILL)
    log(f"{fault.at:7.1f} s  {kind} {target} (pid {pid}) after {fault.step} steps")
    if stall:
        time.sleep(args.stall_s)
        alive = _signal(pid, signal.SIGCONT)
        log(f"{watch.now():7.1f} s  SIGCONT {target} (pid {pid}){'' if alive else ': gone, the job had replaced it'}")
    resumed_at = watch.now()
    deadline = time.monotonic() + args.settle_s
    while (done := resolved(watch, fault, resumed_at)) is None:
        if time.monotonic() > deadline or watch.proc.poll() is not None:
            log(f"{watch.now():7.1f} s  {kind} {target}: not resolved in {args.settle_s:.0f} s")
            return fault
        time.sleep(1.0)
    fault.recovered_after = done[0] - fault.at
    log(f"{watch.now():7.1f} s  {kind} {target} resolved after {fault.recovered_after:.1f} s")
    return fault


def soak(args, log) -> dict:
    run_root = Path(args.run_root or tempfile.mkdtemp(prefix="chaos-soak-"))
    config_path = args.out / "job.yaml"
    config_path.write_text(yaml.safe_dump(soak_job(tiny_model(args.model), run_root, args), sort_keys=False))
    command = train_command(config_path, args.set)
    run_dir = run_root / "run"
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    watch = Watch(proc, run_dir, args.out / "train.log", args.scrape_s)
    rng = random.Random(args.seed)
    faults: list[Fault] = []
    try:
        while not watch.started and proc.poll() is None:
            time.sleep(1.0)
        workers = load_config(run_dir / "config.yaml").rollout.pool.size
        log(f"{watch.now():7.1f} s  first step done; soaking for {args.minutes:g} min")
        end, next_at = args.minutes * 60, rng.uniform(*args.interval)
        while proc.poll() is None and watch.now() < end:
            if watch.now() < next_at or next_at >= end:
                time.sleep(1.0)
                continue
            fault = inject(watch, rng, args, workers, log)
            faults += [fault] if fault is not None else []
            if fault is None or not fault.recovered:
                break
            next_at = max(next_at + rng.uniform(*args.interval), watch.now())
    finally:
        watch.scraping = False
        stopped_at = watch.now()
        for fault in faults:
            if fault.kind.startswith("stall"):
                _signal(fault.pid, signal.SIGCONT)
        stop_s = None
        if proc.poll() is None:
            log(f"{stopped_at:7.1f} s  SIGINT: the job finishes its step and stops")
            interrupt(proc, args.grace_s)
            stop_s = watch.now() - stopped_at
        watch.finish()
    clean = proc.returncode == SIGINT_EXIT and stop_s is not None and stop_s < args.grace_s / 2
    return report(args, command, run_dir, proc.returncode, clean, watch, faults, stopped_at)


# ---------------------------------------------------------------------- the report

def report(args, command, run_dir: Path, returncode: int, clean: bool, watch: Watch, faults: list[Fault],
           stopped_at: float) -> dict:
    """`clean`: the job stopped on the first SIGINT (within half of --grace-s, when `interrupt` sends the second)."""
    events, records = watch.snapshot()
    for i, fault in enumerate(faults):
        until = faults[i + 1].at if i + 1 < len(faults) else float("inf")
        fault.events = [e for t, e in events if fault.at < t <= until]
    config = load_config(run_dir / "config.yaml")
    ledger = [json.loads(line) for line in lines(run_dir / "ledger.jsonl")]
    audit = audit_ledger(ledger, expected_ids(config, len(ledger)))
    continuity = check_continuity(watch.scrapes, [e for _, e in events], config.run.checkpoint_every)
    ok = audit.exactly_once and continuity.continuous and all(f.recovered for f in faults) and clean
    return {
        "command": [sys.executable, "-m", "sparrow.bench.chaos_soak", *args.argv], "job_command": command,
        "run_dir": str(run_dir), "seed": args.seed, "minutes": args.minutes, "stopped_at_s": stopped_at,
        "job_exit_code": returncode, "clean_stop": clean, "ok": ok, "steps": audit.steps,
        "faults": [asdict(f) for f in faults], "faults_by_kind": dict(Counter(f.kind for f in faults)),
        "events": [dict(e, seen_at_s=t) for t, e in events],
        "ledger": {**asdict(audit), "lost": audit.lost[:50], "duplicated": audit.duplicated[:50],
                   "unexpected": audit.unexpected[:50], "lost_count": len(audit.lost),
                   "duplicated_count": len(audit.duplicated), "unexpected_count": len(audit.unexpected)},
        "continuity": {**asdict(continuity), "continuous": continuity.continuous},
        "job_output_tail": list(watch.tail),
    }


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _recoveries(events: list[dict]) -> str:
    """Per kind: how many, and the median and longest recovery time."""
    parts = []
    for kind, n in sorted(Counter(e["kind"] for e in events).items()):
        times = sorted(e["recovery_seconds"] for e in events if e["kind"] == kind and e["recovery_seconds"] is not None)
        parts.append(f"{kind} {n}" + (f" ({times[len(times) // 2]:.1f} / {times[-1]:.1f})" if times else ""))
    return ", ".join(parts) or "none"


def tables(result: dict) -> str:
    from sparrow.tables import format_table

    ledger, continuity, faults = result["ledger"], result["continuity"], result["faults"]
    summary = [
        ["soak (from the first step)", f"{result['stopped_at_s'] / 60:.1f} min, seed {result['seed']}"],
        ["steps completed", result["steps"]],
        ["faults injected", ", ".join(f"{k} {n}" for k, n in sorted(result["faults_by_kind"].items())) or "none"],
        ["faults resolved", f"{sum(f['recovered_after'] is not None for f in faults)} of {len(faults)}"],
        ["job recoveries (median / max s)", _recoveries(result["events"])],
        ["samples dispatched / trained", f"{ledger['dispatched']} / {ledger['trained']}"],
        ["lost / duplicated / unexpected",
         f"{ledger['lost_count']} / {ledger['duplicated_count']} / {ledger['unexpected_count']}"],
        ["attempts abandoned / samples dropped", f"{ledger['abandoned_attempts']} / {ledger['dropped_samples']}"],
        ["metric series continuous", f"{'yes' if continuity['continuous'] else 'NO'} ({continuity['scrapes']} scrapes, "
         f"{continuity['unanswered']} unanswered, {continuity['series']} series, "
         f"{len(continuity['step_drops'])} train_step drops)"],
        ["job exit", f"{result['job_exit_code']} "
         f"({'stopped on the first SIGINT' if result['clean_stop'] else 'NOT a clean stop'})"],
    ]
    rows = [[i + 1, f"{f['at'] / 60:.1f}", f["kind"], f["target"], "-" if f["step"] is None else f["step"],
             "; ".join(f"{e['kind']} {e['subject']} {_seconds(e['recovery_seconds'])}" for e in f["events"]) or "-",
             "NO" if f["recovered_after"] is None else f"{f['recovered_after']:.1f}"] for i, f in enumerate(faults)]
    problems = continuity["disappeared"] + continuity["decreased"] + continuity["unexplained_drops"]
    return "\n\n".join(filter(None, [
        format_table(["", "result"], summary),
        format_table(["#", "at min", "fault", "target", "steps done", "job events (kind, who, recovery s)",
                      "resolved after s"], rows) if rows else "no faults injected",
        "continuity problems:\n" + "\n".join(problems[:20]) if problems else "",
    ]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparrow.bench.chaos_soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=30.0,
                   help="how long faults are injected, from the job's first step")
    p.add_argument("--seed", type=int, default=0, help="seeds the fault schedule, kinds and targets")
    p.add_argument("--interval", type=float, nargs=2, default=[120.0, 300.0], metavar=("MIN_S", "MAX_S"),
                   help="seconds between faults, uniform within")
    p.add_argument("--faults", type=lambda s: s.split(","), default=list(FAULT_KINDS),
                   help=f"comma-separated kinds to draw from (default: {','.join(FAULT_KINDS)})")
    p.add_argument("--lease-timeout-s", type=float, default=20.0, help="run.recovery.lease_timeout_s")
    p.add_argument("--hung-worker-timeout-s", type=float, default=10.0, help="run.recovery.hung_worker_timeout_s")
    p.add_argument("--stall-s", type=float, help="how long a stall lasts (default: lease + hung-worker timeout + 10)")
    p.add_argument("--settle-s", type=float, default=600.0,
                   help="stop when a fault is not resolved (or the job not whole again) in this many seconds")
    p.add_argument("--scrape-s", type=float, default=2.0, help="seconds between looks at the run and scrapes")
    p.add_argument("--grace-s", type=float, default=240.0, help="seconds the job gets to stop after SIGINT")
    p.add_argument("--model", type=Path, default=Path.home() / ".cache" / "sparrow" / "tiny-qwen3",
                   help="the tiny model's directory (built there if missing)")
    p.add_argument("--run-root", type=Path, help="where the job's run directory goes (default: a new temporary one)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for the job")
    p.add_argument("--out", type=Path, required=True, help="folder for soak.json, job.yaml and train.log")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    unknown = [k for k in args.faults if k not in FAULT_KINDS]
    if unknown:
        p.error(f"--faults {','.join(args.faults)}: {', '.join(unknown)} unknown; "
                f"choose from {', '.join(FAULT_KINDS)}")
    if not 0 < args.interval[0] <= args.interval[1]:
        p.error(f"--interval {args.interval[0]:g} {args.interval[1]:g}: need 0 < MIN_S <= MAX_S")
    if args.minutes <= 0:
        p.error(f"--minutes {args.minutes:g}: must be > 0")
    args.stall_s = args.stall_s or args.lease_timeout_s + args.hung_worker_timeout_s + 10
    if args.stall_s <= args.lease_timeout_s:
        p.error(f"--stall-s {args.stall_s:g}: a stall must outlast the lease "
                f"(--lease-timeout-s {args.lease_timeout_s:g})")
    args.out.mkdir(parents=True, exist_ok=True)
    result = soak(args, log=lambda line: print(line, flush=True))
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    print(tables(result))
    print(f"results: {args.out / 'soak.json'}; job log: {args.out / 'train.log'}; run: {result['run_dir']}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
