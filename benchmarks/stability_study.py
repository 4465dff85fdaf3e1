"""The stability study (issue 15, docs/stability.md): one arm per invocation, then a merge into a table and plots.

    python3 benchmarks/stability_study.py --arm b --config CFG --steps 20 --out-dir OUT [--set KEY=VALUE ...]
    python3 benchmarks/stability_study.py --merge OUT/arm-*.json --out-dir OUT

An arm runs `python3 -m sparrow.cli.main train` (works installed and from a PYTHONPATH checkout) with the arm's
overrides, same seed and steps as the others, a dense held-out eval before the first and after the last step, and
a wall-time cap: at the cap the job is interrupted (it shuts down cleanly) and the arm JSON keeps the steps done.
"""

import argparse
import json
import math
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stability.arms import ARMS, arm_overrides  # noqa: E402
from stability.plots import plot_all  # noqa: E402
from stability.summary import EXACT_HEADERS, TABLE_HEADERS, arm_summary, exact_row, has_exact, step_row, table_row  # noqa: E402
from train_runs import interrupt, step_records, train_command  # noqa: E402


def _fail(message: str) -> None:
    print(f"stability_study: {message}", file=sys.stderr)
    sys.exit(2)


def _key(override: str) -> str:
    """The config key of a `KEY=VALUE` override."""
    return override.split("=", 1)[0].strip()


def _study_overrides(args) -> tuple[list[str], dict]:
    """The arm's --set list (arm, then the study's fixed keys, then the user's) and the facts the summary needs."""
    from sparrow.coordinator.config import ConfigError, load_config

    try:
        config = load_config(args.config, args.set)
        native = config.rollout.native
        arm_sets = arm_overrides(args.arm, config.initial_schedule(), config.controller.target if args.tau is None
                                 else args.tau, config.controller.ladder, native.max_model_len, args.fixed_topk)
    except (ConfigError, ValueError) as exc:
        _fail(str(exc))
    study = [f"run.steps={args.steps}", f"run.seed={args.seed}", f"run.out_dir={args.runs_dir}", f"run.name=arm-{args.label}",
             f"data.eval.every={args.steps}", "data.eval.modes=[dense]", "run.checkpoint_every=0"]
    owned = {_key(item): "the arm" for item in arm_sets} | {_key(item): "the study" for item in study}
    for item in args.set:
        if (key := _key(item)) in owned:
            _fail(f"--set {key}: {owned[key]} sets this key (a later --set would replace it silently); put the value in "
                  f"the --config file instead (the arms keep its bins and schedule), or use the option for it "
                  f"(--steps, --seed, --tau, --fixed-topk, --out-dir, --runs-dir, --label)")
    sets = arm_sets + study + args.set
    try:
        final = load_config(args.config, sets)  # validates the combination before Ray starts
    except ConfigError as exc:
        _fail(str(exc))
    bins = final.schedule_template()
    ends = list(bins.edges) + [final.rollout.native.max_model_len]
    return sets, {"tau": final.controller.target, "edges": list(bins.edges),
                  "dense_blocks": [math.ceil(end / bins.block_size) for end in ends]}


SMALL_RUN_FILES = ("config.yaml", "metrics.jsonl", "controller_decisions.jsonl", "events.jsonl", "report")
"""What of a run directory is kept next to the arm JSON when --runs-dir puts the run (and its checkpoint) elsewhere."""


def _keep_small_files(run_dir: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for name in SMALL_RUN_FILES:
        src = run_dir / name
        if src.is_dir():
            shutil.copytree(src, dest / name, dirs_exist_ok=True)
        elif src.is_file():
            shutil.copy2(src, dest / name)


def run_arm(args) -> Path:
    out_dir = args.out_dir.resolve()
    args.runs_dir = (args.runs_dir or out_dir).resolve()
    run_dir = args.runs_dir / f"arm-{args.label}"
    if run_dir.exists():
        _fail(f"{run_dir} exists; pick another --out-dir/--runs-dir or remove it (each arm starts from a fresh run "
              "directory)")
    out_dir.mkdir(parents=True, exist_ok=True)
    args.out_dir = out_dir
    sets, facts = _study_overrides(args)
    command = train_command(args.config, sets)
    print(f"arm {args.label}: {ARMS[args.arm]}; {args.steps} steps, cap {args.max_wall_s:.0f} s", flush=True)
    print("command: " + shlex.join(command), flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(command)  # its one line per step is the progress

    def write(capped: bool) -> Path:
        records = step_records(run_dir)
        if args.runs_dir != out_dir and run_dir.is_dir():
            _keep_small_files(run_dir, out_dir / f"arm-{args.label}")
        summary = arm_summary(args.arm, args.label, ARMS[args.arm], command, records, capped, proc.returncode, **facts)
        summary["wall_s"] = round(time.monotonic() - start, 1)
        path = out_dir / f"arm-{args.label}.json"
        path.write_text(json.dumps(summary, indent=1))
        print(f"arm {args.label}: {len(records)} steps in {summary['wall_s']:.0f} s (exit {proc.returncode}); {path}",
              flush=True)
        return path

    try:
        proc.wait(args.max_wall_s)
        return write(capped=False)
    except subprocess.TimeoutExpired:
        print(f"arm {args.label}: wall cap {args.max_wall_s:.0f} s reached; interrupting the job", flush=True)
        write(capped=True)  # the steps done so far are kept even if the machine's own limit ends us while it shuts down
        interrupt(proc, args.grace_s)
        return write(capped=True)


def merge(paths: list[Path], out_dir: Path) -> Path:
    from sparrow.tables import markdown_table

    arms = []
    for path in paths:
        try:
            arm = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            _fail(f"--merge {path}: not an arm JSON ({exc})")
        kept = path.with_suffix("") / "metrics.jsonl"  # the run's records kept beside it: rebuilt with today's fields
        if kept.is_file():
            arm["steps"] = [step_row(r) for r in step_records(kept.parent)]
        arms.append(arm)
    arms.sort(key=lambda a: (list(ARMS).index(a["arm"]), a["label"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    table = markdown_table(TABLE_HEADERS, [table_row(a) for a in arms])
    exact = [a for a in arms if has_exact(a)]
    if exact:
        table += "\n\nExact α (trainer.exact_alpha) beside the top-K bounds, and the trainer's seconds per step:\n\n"
        table += markdown_table(EXACT_HEADERS, [exact_row(a) for a in exact])
    plots = plot_all(arms, out_dir)
    results = out_dir / "stability.json"
    results.write_text(json.dumps({"arms": arms, "table": table, "plots": [p.name for p in plots]}, indent=1))
    (out_dir / "stability.md").write_text(table + "\n\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n")
    print(table)
    print(f"results: {results}; table: {out_dir / 'stability.md'}; plots: {', '.join(p.name for p in plots)}")
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--arm", choices=list(ARMS), help="; ".join(f"{k}: {v}" for k, v in ARMS.items()))
    mode.add_argument("--merge", nargs="+", type=Path, metavar="ARM_JSON", help="merge arm JSONs into a table and plots")
    p.add_argument("--config", type=Path, help="job config (default: the embedded default job)")
    p.add_argument("--label", help="name of this run of the arm (default the arm): its run, JSON, table row and plot "
                   "line, so a variant of an arm (e.g. b with wider top-k lists) sits beside the arm itself")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="extra override for train (repeatable)")
    p.add_argument("--steps", type=int, default=20, help="GRPO steps of the arm (the same for every arm)")
    p.add_argument("--seed", type=int, default=0, help="run.seed (the same for every arm)")
    p.add_argument("--tau", type=float, help="controller.target (default: the config's)")
    p.add_argument("--fixed-topk", type=int, default=8, help="arm c's top-k blocks in every bin")
    p.add_argument("--max-wall-s", type=float, default=480.0, help="interrupt the job after this many seconds")
    p.add_argument("--grace-s", type=float, default=60.0, help="seconds an interrupted job gets to shut down")
    p.add_argument("--out-dir", type=Path, required=True, help="arm JSONs (and run directories), or the merged results")
    p.add_argument("--runs-dir", type=Path, help="run directories here instead (their checkpoint is large); "
                   "config, metrics, decisions, events and report are copied to OUT_DIR/arm-<arm>/")
    args = p.parse_args(argv)
    args.label = args.label or args.arm
    if args.arm and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", args.label):
        _fail(f"--label {args.label!r}: use letters, digits, '.', '_' or '-' (it names files)")
    if args.steps < 1:
        _fail(f"--steps {args.steps}: must be >= 1")
    if args.merge:
        merge(args.merge, args.out_dir)
    else:
        run_arm(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
