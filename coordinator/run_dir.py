"""A run directory: what a `sparrow train` job leaves behind, and what `--resume` reads back.

    RUN_DIR/config.yaml                 the effective config (resume reads it)
    RUN_DIR/metrics.jsonl               one line per step
    RUN_DIR/controller_decisions.jsonl  one line per step: every bin's decision and its reason
    RUN_DIR/events.jsonl                failures recovered from (and pool resizes), with recovery times
    RUN_DIR/checkpoints/<tag>/          DeepSpeed checkpoint (model, optimizer, LR schedule)
    RUN_DIR/checkpoints/latest          DeepSpeed's pointer to the newest tag
    RUN_DIR/checkpoints/<tag>.json      coordinator state at that tag (step, controller, schedule)
    RUN_DIR/hf/stepN/                   the policy as a Hugging Face model directory (run.export_hf_every)
    RUN_DIR/tensorboard/                TensorBoard event files (run.loggers has 'tensorboard')
    RUN_DIR/wandb/offline-run-*/        the W&B run (run.loggers has 'wandb', run.wandb.mode offline)
    RUN_DIR/report/                     report.md and PNG plots
    RUN_DIR/control/                    while the job runs: how `sparrow pool` reaches it (transport/endpoint.py)
    RUN_DIR/prometheus_targets.json     the live processes' /metrics, for Prometheus file_sd (docs/metrics.md)
"""

import json
import math
import shutil
import time
from pathlib import Path

from sparrow.jsonl import read_jsonl


def _clean(value):
    """JSON-safe: NaN/inf become null, tuples lists, tensors and numpy scalars plain numbers."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "tolist"):
        return _clean(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.checkpoints = self.path / "checkpoints"
        self.report = self.path / "report"

    @classmethod
    def create(cls, out_dir: str | Path, name: str | None) -> "RunDir":
        name = name or time.strftime("train-%Y%m%d-%H%M%S")
        path = Path(out_dir) / name
        if path.exists() and any(path.iterdir()):
            raise FileExistsError(f"run directory {path} exists and is not empty; pick another run.name or --resume it")
        path.mkdir(parents=True, exist_ok=True)
        return cls(path)

    @property
    def config_file(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics_file(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def decisions_file(self) -> Path:
        return self.path / "controller_decisions.jsonl"

    @property
    def ledger_file(self) -> Path:
        """One line per trained step: which sample ids each rank trained on (`coordinator/job/ledger.py`)."""
        return self.path / "ledger.jsonl"

    @property
    def events_file(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def tensorboard_dir(self) -> Path:
        return self.path / "tensorboard"

    @property
    def prometheus_targets_file(self) -> Path:
        """Kept by `sparrow.coordinator.metrics.ScrapeTargets` (its TARGETS_FILE) while the job runs."""
        return self.path / "prometheus_targets.json"

    def append(self, file: Path, record: dict) -> None:
        with file.open("a") as f:
            f.write(json.dumps(_clean(record)) + "\n")

    @staticmethod
    def read_jsonl(file: Path) -> list[dict]:
        return read_jsonl(file) if file.exists() else []

    def truncate_after(self, step: int) -> None:
        """Drop log lines of steps >= `step` (a resumed job redoes them)."""
        for file in (self.metrics_file, self.decisions_file, self.ledger_file):
            rows = [r for r in self.read_jsonl(file) if r["step"] < step]
            file.write_text("".join(json.dumps(r) + "\n" for r in rows))

    # ------------------------------------------------------------------ checkpoints

    def latest_tag(self) -> str | None:
        latest = self.checkpoints / "latest"
        return latest.read_text().strip() if latest.is_file() else None

    def checkpoint_tags(self) -> list[str]:
        """Tags of the DeepSpeed checkpoints on disk, oldest first."""
        found = self.checkpoints.glob("step*") if self.checkpoints.is_dir() else []
        tags = [p.name for p in found if p.is_dir() and p.name.removeprefix("step").isdigit()]
        return sorted(tags, key=lambda t: int(t.removeprefix("step")))

    def checkpoint_tag(self, step: int | None = None) -> str:
        """The tag of the checkpoint at `step` (None = the latest); FileNotFoundError naming what exists."""
        tags = self.checkpoint_tags()
        if not tags:
            raise FileNotFoundError(
                f"{self.path}: no checkpoint yet (nothing under checkpoints/); a run writes one at its end and every "
                "run.checkpoint_every steps"
            )
        tag = self.latest_tag() if step is None else f"step{step}"
        if tag is None:
            raise FileNotFoundError(
                f"{self.path}: checkpoints/latest is missing (a save cut short?); name the step, one of {', '.join(tags)}"
            )
        if tag not in tags:
            raise FileNotFoundError(
                f"{self.path}: no checkpoint at {'the latest step' if step is None else f'step {step}'} ({tag}); on disk: "
                f"{', '.join(tags)} (run.keep_checkpoints sets how many are kept)"
            )
        return tag

    def hf_dir(self, step: int) -> Path:
        return self.path / "hf" / f"step{step}"

    def save_state(self, tag: str, state: dict, keep: int) -> None:
        (self.checkpoints / f"{tag}.json").write_text(json.dumps(_clean(state)))
        tags = sorted((p.stem for p in self.checkpoints.glob("*.json")), key=lambda t: int(t.removeprefix("step")))
        for old in tags[:-keep]:
            shutil.rmtree(self.checkpoints / old, ignore_errors=True)
            (self.checkpoints / f"{old}.json").unlink(missing_ok=True)

    def load_state(self) -> tuple[str, dict]:
        tag = self.latest_tag()
        if tag is None:
            raise FileNotFoundError(f"--resume {self.path}: no checkpoint there yet (no checkpoints/latest)")
        state_file = self.checkpoints / f"{tag}.json"
        if not state_file.is_file():
            raise FileNotFoundError(f"--resume {self.path}: checkpoint {tag} has no coordinator state ({state_file.name})")
        return tag, json.loads(state_file.read_text())
