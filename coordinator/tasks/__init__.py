"""The built-in verifiable tasks, selected by `data.source`; each has its config section `data.<name>`.

- `arithmetic`: short integer expressions (the embedded default).
- `lookup`: multi-hop variable lookup in a long context (docs/tasks.md).
- `needle`: key → value retrieval in a long context (docs/tasks.md).

Every answer is an integer, judged by the integer reward (`reward.type: auto`).
"""

from .arithmetic import ArithmeticConfig, ArithmeticTask, evaluate
from .base import Item, Task, TaskConfig
from .lookup import LookupConfig, LookupTask
from .needle import NeedleConfig, NeedleTask

TASKS: dict[str, type[Task]] = {"arithmetic": ArithmeticTask, "lookup": LookupTask, "needle": NeedleTask}

__all__ = [
    "TASKS", "ArithmeticConfig", "ArithmeticTask", "Item", "LookupConfig", "LookupTask", "NeedleConfig", "NeedleTask",
    "Task", "TaskConfig", "evaluate",
]
