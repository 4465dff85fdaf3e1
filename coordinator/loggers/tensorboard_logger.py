"""`tensorboard`: the record's scalars as TensorBoard event files, step = `StepRecord.step`."""

from pathlib import Path

from sparrow.coordinator.step_record import StepRecord

from .base import import_backend
from .scalars import step_scalars


class TensorBoardLogger:
    def __init__(self, log_dir: Path):
        self.summary_writer = import_backend("torch.utils.tensorboard", "tensorboard").SummaryWriter
        self.log_dir = log_dir
        self.writer = None

    def log_step(self, record: StepRecord) -> None:
        if self.writer is None:
            # Opened at the first step logged: a resumed run redoes the steps after its checkpoint, and
            # purge_step hides the earlier run's events from that step on (as metrics.jsonl drops its lines).
            self.writer = self.summary_writer(str(self.log_dir), purge_step=record.step)
        for tag, value in step_scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=record.step)
        self.writer.flush()  # steps are seconds to minutes apart: each shows in TensorBoard at once

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
