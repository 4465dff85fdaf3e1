"""`Ledger`: which sample ids each trainer rank trained on at each step, in the surviving lineage, and
RUN_DIR/ledger.jsonl, its record on disk (docs/reliability.md, "The ledger").

Exactly-once training is checked against it: a step redone after a trainer recovery or a resume replaces the
lines of the steps it redoes (`RunDir.truncate_after` cuts them with the metrics), so no id is counted twice
and none that was trained is lost — and an operator, or a check after a crash, can verify that from the file.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class LedgerLine:
    step: int
    policy_version: int
    """The policy that trained on the step's samples (its update made version + 1)."""
    schedule_versions: list[int]
    """The schedules the step's samples were decoded under."""
    trained_ids: list[list[str]]
    """Per trainer rank, the sample ids it trained on."""
    abandoned_attempts: list[str] = field(default_factory=list)
    """Request ids of the step's lease attempts given up (their samples never trained)."""
    dropped_samples: list[str] = field(default_factory=list)
    """Sample ids the trainer received from abandoned attempts and discarded."""


class Ledger:
    def __init__(self, path: Path | None = None):
        """`path`: the run's ledger.jsonl (None: in memory only)."""
        self.path = path
        self.steps: dict[int, LedgerLine] = {}

    def record(self, line: LedgerLine) -> None:
        self.steps[line.step] = line
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(asdict(line)) + "\n")

    def load(self) -> None:
        """The lines on disk (a resumed run continues its lineage; the file was cut at the resumed step)."""
        self.steps = {}
        if self.path is not None and self.path.exists():
            for text in self.path.read_text().splitlines():
                line = LedgerLine(**json.loads(text))
                self.steps[line.step] = line

    def trained_ids(self) -> list[list[str]]:
        """Per trainer rank, the sample ids it trained on (in step order)."""
        ranks = max((len(v.trained_ids) for v in self.steps.values()), default=0)
        return [[i for k in sorted(self.steps) for i in (self.steps[k].trained_ids[r] if r < len(self.steps[k].trained_ids) else [])]
                for r in range(ranks)]
