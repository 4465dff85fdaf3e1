"""`sparrow train [--config FILE] [--set KEY=VALUE ...] [--resume RUN_DIR] [--print-config]`: the main job.

Without a file it runs the embedded default: local Ray on CPU, SmolLM2-135M-Instruct (fetched if
missing), the arithmetic task, sparse rollouts from the native engine, one DeepSpeed rank and the
sparsity controller (docs/coordinator.md).
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


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


class SignalStop:
    """The handler of SIGINT and SIGTERM (Ctrl-C; Slurm's cancel and time limit, `ray job stop`, `timeout`), as a
    context that installs it and puts the previous handlers back. While the job starts, a signal stops it at once.
    Once it runs (`attach`), the first signal asks it to finish the step under way and checkpoint it, and a second
    one stops it at once.

    A stop at once raises KeyboardInterrupt, and which signal it was is kept here (`at_once`), not in the exception:
    `ray.get` turns any exception raised by a handler while it waits into a plain KeyboardInterrupt."""

    def __init__(self):
        self.job = None
        self.signum: int | None = None
        self.at_once: int | None = None

    def __enter__(self) -> "SignalStop":
        """SIGINT is set explicitly because a non-interactive shell starts background commands with it ignored
        (Slurm's batch script)."""
        self.previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        if threading.current_thread() is threading.main_thread():
            for sig, old in self.previous.items():
                signal.signal(sig, old)

    def install(self) -> None:
        """Only the main thread may set handlers; a job run from another thread keeps the process's own."""
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                signal.signal(sig, self)

    def attach(self, job) -> None:
        """Take both signals again (`ray.init` puts in its own SIGTERM handler, which exits without a checkpoint
        or the report) and let the first one stop `job` at its next step boundary."""
        self.job = job
        self.install()

    def __call__(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.job is None or self.signum is not None:
            self.at_once = signum
            raise KeyboardInterrupt(name)
        self.signum = signum
        self.job.request_stop(name)
        print(f"\n{name}: stopping after step {self.job.step + 1} with a checkpoint; {name} again stops at once",
              file=sys.stderr, flush=True)


def train(config, run_dir, resume: bool, progress: bool) -> int:
    from sparrow.cli.main import CliError
    from sparrow.coordinator.driver import TrainingJob
    from sparrow.coordinator.pools import PlacementError
    from sparrow.coordinator.report import write_report

    start = time.perf_counter()
    print(f"run directory: {run_dir.path}")
    signals = SignalStop()
    try:
        with signals, TrainingJob(config, run_dir, resume=resume, progress=progress) as job:
            signals.attach(job)
            if job.step >= config.run.steps:
                print(f"nothing to do: the run is at step {job.step} of run.steps={config.run.steps} "
                      f"(raise it with --set run.steps=N)")
                return 0
            job.run()
    except PlacementError as exc:
        raise CliError(str(exc)) from None
    except KeyboardInterrupt:
        if signals.at_once is None:
            return _stopped(run_dir, "interrupted", signal.SIGINT)
        return _stopped(run_dir, f"stopped at once by {signal.Signals(signals.at_once).name}", signals.at_once)
    if signals.signum is not None and job.step < config.run.steps:
        return _stopped(run_dir, f"stopped by {job.stop_reason} after step {job.step}", signals.signum)
    report = write_report(run_dir)
    minutes, seconds = divmod(time.perf_counter() - start, 60)
    print(f"done in {int(minutes)} min {seconds:.0f} s; report: {report}")
    return 0


def _stopped(run_dir, what: str, signum: int) -> int:
    """Say how the run stopped and how to continue it, write the report of its steps; the shell's exit code."""
    from sparrow.coordinator.report import write_report

    tag = run_dir.latest_tag()
    hint = (f"checkpoint {tag} is the latest; continue with: sparrow train --resume {run_dir.path}" if tag
            else "no checkpoint was written yet (run.checkpoint_every sets how often)")
    print(f"\n{what}; everything started was shut down. {hint}", file=sys.stderr)
    if run_dir.metrics_file.is_file():
        print(f"report of the steps done: {write_report(run_dir)}", file=sys.stderr)
    return 128 + signum
