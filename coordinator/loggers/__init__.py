"""Experiment tracking: each training step's `StepRecord` goes to every logger in `run.loggers`.

    loggers = open_loggers(config, run_dir)   # at job start: a missing package or W&B login fails here
    loggers.log_step(record)                  # after every step
    loggers.close()                           # at exit: flushes the event files, finishes the W&B run

`jsonl` writes RUN_DIR/metrics.jsonl; `tensorboard` and `wandb` plot `step_scalars(record)`
(docs/tracking.md).
"""

import contextlib

from sparrow.coordinator.config import SparrowConfig
from sparrow.coordinator.run_dir import RunDir

from .base import Loggers, MetricLogger
from .jsonl_logger import JsonlLogger
from .scalars import step_scalars
from .tensorboard_logger import TensorBoardLogger
from .wandb_logger import WandbLogger

BACKENDS = {
    "jsonl": lambda config, run_dir: JsonlLogger(run_dir),
    "tensorboard": lambda config, run_dir: TensorBoardLogger(run_dir.tensorboard_dir),
    "wandb": WandbLogger,
}


def open_loggers(config: SparrowConfig, run_dir: RunDir) -> Loggers:
    """The loggers of `run.loggers`, in its order (those opened are closed again if a later one fails)."""
    opened: list[MetricLogger] = []
    try:
        for name in config.run.loggers:
            opened.append(BACKENDS[name](config, run_dir))
    except BaseException:
        with contextlib.suppress(Exception):  # the error that stopped the opening is the one to report
            Loggers(opened).close()
        raise
    return Loggers(opened)


__all__ = ["Loggers", "MetricLogger", "open_loggers", "step_scalars"]
