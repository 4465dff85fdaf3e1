"""`sparrow train` as a subprocess, for the benchmark harnesses (stability study, pool scaling): the command
line (installed or from a PYTHONPATH checkout), a clean interrupt, and the step records a run has written."""

import signal
import subprocess
import sys
from pathlib import Path


def train_command(config: Path | None, sets: list[str]) -> list[str]:
    command = [sys.executable, "-m", "sparrow.cli.main", "train", "--no-progress"]
    command += ["--config", str(config)] if config else []
    return command + [a for s in sets for a in ("--set", s)]


def interrupt(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGINT: the job finishes its step, checkpoints it, shuts its pools down and writes its report. If it has not
    ended after half of `grace_s` (a long step), a second SIGINT stops it at once (pools shut down, report
    written, no new checkpoint); SIGKILL if it has not ended in `grace_s`."""
    for _ in range(2):
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(grace_s / 2)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.kill()
    proc.wait()


def step_records(run_dir: Path) -> list[dict]:
    """The run's step records so far (RUN_DIR/metrics.jsonl), oldest first."""
    from sparrow.jsonl import read_jsonl

    path = run_dir / "metrics.jsonl"
    return read_jsonl(path) if path.is_file() else []
