"""`sparrow train [--config FILE] [--set KEY=VALUE ...] [--resume RUN_DIR] [--print-config]`: the main job.

Without a file it runs the embedded default: local Ray on CPU, SmolLM2-135M-Instruct (fetched if
missing), the arithmetic task, sparse rollouts from the native engine, one DeepSpeed rank and the
sparsity controller (docs/coordinator.md).
"""

import os
import sys
import time
from pathlib import Path


def configure(p) -> None:
    p.add_argument("--config", type=Path, help="YAML job config (default: the embedded default job)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set run.steps=10 --set trainer.optimizer.lr=1e-6 (repeatable)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a run from its last checkpoint")
    p.add_argument("--print-config", action="store_true", help="print the effective config as YAML and exit")
    p.add_argument("--no-progress", action="store_true", help="no progress bars (one line per step only)")
    p.set_defaults(handler=run)


def run(args) -> int:
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # no C-core notices (GOAWAY at shutdown) between the bars
    from sparrow.cli.main import CliError
    from sparrow.coordinator.config import load_config
    from sparrow.coordinator.run_dir import RunDir

    if args.resume and args.config:
        raise CliError("--resume takes the run's own config.yaml; drop --config (use --set to change keys)")
    if args.resume:
        run_dir = RunDir(args.resume)
        if not run_dir.config_file.is_file():
            raise CliError(f"--resume {args.resume}: not a run directory (no config.yaml)")
        config = load_config(run_dir.config_file, args.set)
    else:
        config = load_config(args.config, args.set)
    if args.print_config:
        print(config.dump(), end="")
        return 0
    if not args.resume:
        run_dir = RunDir.create(config.run.out_dir, config.run.name)
    run_dir.config_file.write_text(config.dump())
    return train(config, run_dir, resume=bool(args.resume), progress=not args.no_progress)


def train(config, run_dir, resume: bool, progress: bool) -> int:
    from sparrow.cli.main import CliError
    from sparrow.coordinator.driver import TrainingJob
    from sparrow.coordinator.pools import PlacementError
    from sparrow.coordinator.report import write_report

    start = time.perf_counter()
    print(f"run directory: {run_dir.path}")
    try:
        with TrainingJob(config, run_dir, resume=resume, progress=progress) as job:
            if job.step >= config.run.steps:
                print(f"nothing to do: the run is at step {job.step} of run.steps={config.run.steps} "
                      f"(raise it with --set run.steps=N)")
                return 0
            job.run()
    except PlacementError as exc:
        raise CliError(str(exc)) from None
    except KeyboardInterrupt:
        tag = run_dir.latest_tag()
        hint = (f"checkpoint {tag} is the latest; continue with: sparrow train --resume {run_dir.path}" if tag
                else "no checkpoint was written yet (run.checkpoint_every sets how often)")
        print(f"\ninterrupted; everything started was shut down. {hint}", file=sys.stderr)
        if run_dir.metrics_file.is_file():
            print(f"report of the steps done: {write_report(run_dir)}", file=sys.stderr)
        return 130
    report = write_report(run_dir)
    minutes, seconds = divmod(time.perf_counter() - start, 60)
    print(f"done in {int(minutes)} min {seconds:.0f} s; report: {report}")
    return 0
