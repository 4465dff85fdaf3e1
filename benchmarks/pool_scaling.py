"""Pools scaled independently (issue 17): rollout throughput against the number of rollout engines, and the
rollout pool resized under load, each a real `sparrow train` job.

    python3 benchmarks/pool_scaling.py sweep --config CFG --rollout 1 2 4 --steps 6 --out-dir OUT [--set K=V ...]
    python3 benchmarks/pool_scaling.py resize --config CFG --sizes 2 4 3 --every 3 --out-dir OUT [--set K=V ...]

`sweep` runs one job per pool size (same seed, steps and trainer pool) and prints per size: rollout tokens/s
(median over the steps after the first), its scaling efficiency against the smallest size, the step time, the
workers' mean utilisation, and the samples trained, lost and duplicated. `resize` runs one job that starts with
`--sizes[0]` workers and, every `--every` completed steps, asks for the next size (`sparrow pool resize`), then
prints each step: workers serving, rollout tokens/s, samples trained, requeued and duplicated (and, if the job
reaches its wall cap, `sparrow pool status` at that moment). Exactly once: a step trains prompts_per_step x n
samples; `lost` counts the ones it did not, `duplicated` the resends the trainer acked as duplicates (never
trained twice). Results go to OUT/pool-scaling-<mode>.json.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_runs import interrupt, step_records, train_command  # noqa: E402


def _fail(message: str) -> None:
    print(f"pool_scaling: {message}", file=sys.stderr)
    sys.exit(2)


def per_step(records: list[dict], expected: int) -> list[dict]:
    """What each step record says about the pools: workers, rollout tokens/s, samples trained and lost."""
    rows = []
    for r in records:
        rollout = r["rollout"]
        utilisation = rollout.get("utilisation") or {}
        rows.append({
            "step": r["step"], "workers": len(utilisation), "rollout_tokens_per_s": rollout["tokens_per_s"],
            "step_s": r["timing"]["step"], "utilisation": statistics.fmean(utilisation.values()) if utilisation else None,
            "trained": rollout["accepted"], "lost": max(expected - rollout["accepted"], 0),
            "duplicated": rollout["duplicates"], "requeued": rollout.get("requeued", 0),
        })
    return rows


def sweep_summary(size: int, steps: list[dict]) -> dict:
    """One pool size's row: medians over the steps after the first (start-up and compilation), totals over all."""
    timed = steps[1:] or steps
    rates = [s["rollout_tokens_per_s"] for s in timed if s["rollout_tokens_per_s"]]
    utilisation = [s["utilisation"] for s in timed if s["utilisation"] is not None]
    return {"rollout_workers": size, "steps": len(steps),
            "rollout_tokens_per_s": statistics.median(rates) if rates else None,
            "step_s": statistics.median(s["step_s"] for s in timed) if timed else None,
            "utilisation": statistics.fmean(utilisation) if utilisation else None,
            "trained": sum(s["trained"] for s in steps), "lost": sum(s["lost"] for s in steps),
            "duplicated": sum(s["duplicated"] for s in steps)}


def with_efficiency(rows: list[dict]) -> list[dict]:
    """Scaling efficiency: tokens/s per worker against the smallest pool's tokens/s per worker."""
    base = min(rows, key=lambda r: r["rollout_workers"])
    for r in rows:
        ok = r["rollout_tokens_per_s"] and base["rollout_tokens_per_s"]
        r["efficiency"] = (r["rollout_tokens_per_s"] / r["rollout_workers"]) / (
            base["rollout_tokens_per_s"] / base["rollout_workers"]) if ok else None
    return rows


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def sweep_table(rows: list[dict]) -> str:
    from sparrow.tables import markdown_table

    return markdown_table(
        ["rollout workers", "steps", "rollout tok/s", "efficiency", "step s", "utilisation", "trained", "lost",
         "duplicated"],
        [[r["rollout_workers"], r["steps"], _fmt(r["rollout_tokens_per_s"], ".0f"), _fmt(r["efficiency"], ".2f"),
          _fmt(r["step_s"], ".2f"), _fmt(r["utilisation"], ".2f"), r["trained"], r["lost"], r["duplicated"]]
         for r in rows])


def resize_table(steps: list[dict]) -> str:
    from sparrow.tables import markdown_table

    return markdown_table(
        ["step", "workers", "rollout tok/s", "step s", "trained", "lost", "requeued", "duplicated"],
        [[s["step"], s["workers"], _fmt(s["rollout_tokens_per_s"], ".0f"), _fmt(s["step_s"], ".2f"), s["trained"],
          s["lost"], s["requeued"], s["duplicated"]] for s in steps])


def _expected(args, sets: list[str]) -> int:
    """Samples a step trains (prompts_per_step x n); validates the job's config before any job starts."""
    from sparrow.coordinator.config import ConfigError, load_config

    try:
        config = load_config(args.config, sets)
    except ConfigError as exc:
        _fail(str(exc))
    return config.run.prompts_per_step * config.rollout.sampling.n


def _job_sets(args, name: str, size: int) -> list[str]:
    return [f"rollout.pool.size={size}", f"run.steps={args.steps}", f"run.seed={args.seed}",
            f"run.out_dir={args.out_dir / 'runs'}", f"run.name={name}", "run.checkpoint_every=0", *args.set]


def _pool_status(run_dir: Path) -> str:
    """`sparrow pool status` of a running job (what a stalled resize looks like: target, serving, joining)."""
    reply = subprocess.run([sys.executable, "-m", "sparrow.cli.main", "pool", "status", str(run_dir)],
                           capture_output=True, text=True)
    return (reply.stdout + reply.stderr).strip()


def _run(command: list[str], wall_s: float, grace_s: float, during=None, at_cap=None) -> int:
    """Run a job to its end (or its wall cap: `at_cap()` is called, then the job interrupted); `during(proc)` is
    polled 4 times a second."""
    proc = subprocess.Popen(command)
    deadline = time.monotonic() + wall_s
    while proc.poll() is None:
        if time.monotonic() > deadline:
            print(f"pool_scaling: wall cap {wall_s:.0f} s reached; interrupting the job", flush=True)
            if at_cap is not None:
                at_cap()
            interrupt(proc, grace_s)
            break
        if during is not None:
            during(proc)
        time.sleep(0.25)
    return proc.returncode


def sweep(args) -> dict:
    rows, runs = [], []
    for size in args.rollout:
        name = f"sweep-rollout-{size}"
        sets = _job_sets(args, name, size)
        expected = _expected(args, sets)
        command = train_command(args.config, sets)
        print(f"pool_scaling: {size} rollout worker(s), {args.steps} steps", flush=True)
        code = _run(command, args.max_wall_s, args.grace_s)
        steps = per_step(step_records(args.out_dir / "runs" / name), expected)
        rows.append(sweep_summary(size, steps))
        runs.append({"rollout_workers": size, "command": command, "returncode": code, "steps": steps})
    rows = with_efficiency(rows)
    return {"mode": "sweep", "rows": rows, "runs": runs, "table": sweep_table(rows)}


def resize(args) -> dict:
    name = "resize-" + "-".join(map(str, args.sizes))
    sets = _job_sets(args, name, args.sizes[0])
    expected = _expected(args, sets)
    command = train_command(args.config, sets)
    run_dir = args.out_dir / "runs" / name
    pending = list(args.sizes[1:])
    asked: list[dict] = []

    def resize_when_due(_proc) -> None:
        done = len(step_records(run_dir))
        if pending and done >= args.every * (len(asked) + 1):
            size = pending.pop(0)
            reply = subprocess.run([sys.executable, "-m", "sparrow.cli.main", "pool", "resize", str(run_dir),
                                    "--rollout", str(size)], capture_output=True, text=True)
            asked.append({"after_step": done - 1, "rollout": size, "returncode": reply.returncode,
                          "reply": (reply.stdout + reply.stderr).strip()})
            print(f"pool_scaling: after step {done - 1}: resize to {size} -> {asked[-1]['reply']}", flush=True)

    at_cap: dict = {}

    def status_at_cap() -> None:
        at_cap["pool_status"] = _pool_status(run_dir)
        print(f"pool_scaling: pool status at the wall cap:\n{at_cap['pool_status']}", flush=True)

    print(f"pool_scaling: resize {' -> '.join(map(str, args.sizes))} every {args.every} steps, {args.steps} steps",
          flush=True)
    code = _run(command, args.max_wall_s, args.grace_s, resize_when_due, status_at_cap)
    steps = per_step(step_records(run_dir), expected)
    return {"mode": "resize", "command": command, "returncode": code, "resizes": asked, **at_cap, "steps": steps,
            "totals": {k: sum(s[k] for s in steps) for k in ("trained", "lost", "requeued", "duplicated")},
            "table": resize_table(steps)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["sweep", "resize"])
    p.add_argument("--config", type=Path, help="job config (default: the embedded default job)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for train (repeatable)")
    p.add_argument("--rollout", type=int, nargs="+", default=[1, 2], help="sweep: rollout pool sizes, one job each")
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 3], help="resize: the pool's sizes, first at start")
    p.add_argument("--every", type=int, default=3, help="resize: completed steps between resizes")
    p.add_argument("--steps", type=int, default=6, help="steps of each job")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-wall-s", type=float, default=540.0, help="interrupt a job after this many seconds")
    p.add_argument("--grace-s", type=float, default=60.0, help="seconds an interrupted job gets to shut down")
    p.add_argument("--out-dir", type=Path, required=True)
    args = p.parse_args(argv)
    sizes = args.rollout if args.mode == "sweep" else args.sizes
    if args.steps < 1 or args.every < 1 or any(n < 1 for n in sizes):
        _fail(f"--steps {args.steps}, --every {args.every} and pool sizes {sizes} must all be >= 1")
    if args.mode == "resize" and len(args.sizes) < 2:
        _fail(f"--sizes {args.sizes}: give the starting size and at least one more")
    args.out_dir = args.out_dir.resolve()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    result = sweep(args) if args.mode == "sweep" else resize(args)
    path = args.out_dir / f"pool-scaling-{args.mode}.json"
    path.write_text(json.dumps(result, indent=1))
    print(result["table"])
    if args.mode == "resize":
        print(f"totals: {result['totals']}")
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
