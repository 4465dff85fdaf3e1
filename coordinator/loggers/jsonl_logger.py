"""`jsonl`: the record as one line of RUN_DIR/metrics.jsonl (`StepRecord.to_dict`), the file the report
reads and `--resume` truncates."""

from sparrow.coordinator.run_dir import RunDir
from sparrow.coordinator.step_record import StepRecord


class JsonlLogger:
    def __init__(self, run_dir: RunDir):
        self.run_dir = run_dir

    def log_step(self, record: StepRecord) -> None:
        self.run_dir.append(self.run_dir.metrics_file, record.to_dict())

    def close(self) -> None:
        """Nothing to flush: each line is written and the file closed as it is logged."""
