"""What every built-in task is: a typed config, and `item(rng)` → (chat messages, exact answer).

A task draws everything from the `random.Random` it is given; which seed that is (and so the data
order and the train/eval split) is `coordinator/data.py`'s business, not the task's.
"""

import random
from typing import Protocol

from pydantic import BaseModel, ConfigDict

Item = tuple[list[dict], str]
"""(chat messages, reference answer as text)."""


class TaskConfig(BaseModel):
    """Base of the tasks' config sections (`data.arithmetic`, `data.lookup`, `data.needle`)."""

    model_config = ConfigDict(extra="forbid")


class Task(Protocol):
    def __init__(self, config: TaskConfig): ...

    def item(self, rng: random.Random) -> Item: ...
