"""Prompt sources: the built-in tasks (`coordinator/tasks/`), JSONL and Parquet files, and local `datasets` datasets.

Every source is addressed by a global index, and the prompts of step k are indices
[k·P, (k+1)·P) (P = prompts per step): the data order is a pure function of (seed, step), so
resuming at a step needs no saved cursor or RNG state. Finite datasets are reshuffled every epoch
(a seeded permutation); the built-in tasks are infinite and have a held-out eval split.
"""

import hashlib
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from sparrow.jsonl import read_jsonl
from sparrow.seeds import stable_seed

from .config import DataConfig
from .tasks import TASKS, Item, Task


SPARE_INDEX = 1 << 40
"""Where the spare prompts' row stream starts: far past any batch's indices."""

@dataclass(frozen=True)
class PromptRecord:
    """One prompt as the rollout workers receive it: chat messages plus what its reward needs."""

    prompt_id: str
    messages: tuple[dict, ...]
    answer: str
    index: int = 0
    """Global index in the source (for tracing a sample back to its data)."""


EVAL_SHARE = 8
"""One built-in task item in EVAL_SHARE belongs to the eval split, decided by a digest of its text."""

EVAL_STREAM = 0xE7A1
"""Seeds of eval items are stable_seed(seed, EVAL_STREAM, index[, attempt]); of train items stable_seed(seed, index[, attempt])."""

MAX_DRAWS = 1000
"""Draws per index before a task is declared too small to split."""


def in_eval_split(messages: list[dict], answer: str) -> bool:
    """Whether an item is held out for evaluation: a property of its content, so no seed or index can
    ever make a training item equal an eval item (arithmetic's problem space is small enough to repeat)."""
    text = "\x00".join([m["content"] for m in messages] + [answer])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") % EVAL_SHARE == 0


class GeneratedTask:
    """A built-in task's items by (seed, split, index): the first draw whose content falls in the split."""

    size = None
    """Infinite: every index is a new item."""

    def __init__(self, task: Task, seed: int, split: str, source: str):
        self.task, self.seed, self.split, self.source = task, seed, split, source

    def item(self, index: int) -> Item:
        stream = (self.seed, index) if self.split == "train" else (self.seed, EVAL_STREAM, index)
        for attempt in range(MAX_DRAWS):
            messages, answer = self.task.item(random.Random(stable_seed(*stream, attempt) if attempt else stable_seed(*stream)))
            if in_eval_split(messages, answer) == (self.split == "eval"):
                return messages, answer
        raise ValueError(
            f"data.{self.source}: {MAX_DRAWS} draws for index {index} found no {self.split} item; the task has too "
            f"few distinct problems to hold 1 in {EVAL_SHARE} out for eval (widen its value range or terms)"
        )


class TableDataset:
    """Rows with a prompt column (text, or a list of chat messages) and an answer column."""

    def __init__(self, rows: list[dict], config: DataConfig, origin: str):
        if not rows:
            raise ValueError(f"data.path={origin!r}: the dataset has no rows")
        for key in (config.prompt_key, config.answer_key):
            if key not in rows[0]:
                raise ValueError(
                    f"data.path={origin!r}: no column {key!r} (columns: {', '.join(map(str, rows[0]))}); "
                    f"set data.prompt_key / data.answer_key"
                )
        self.rows, self.config, self.origin = rows, config, origin

    @property
    def size(self) -> int:
        return len(self.rows)

    def item(self, index: int) -> Item:
        row = self.rows[index]
        prompt, answer = row.get(self.config.prompt_key), row.get(self.config.answer_key)
        if isinstance(prompt, str):
            messages = [{"role": "user", "content": prompt}]
        elif isinstance(prompt, (list, tuple)) and all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
        else:
            raise ValueError(
                f"{self.origin} row {index}: {self.config.prompt_key!r} must be a string or a list of "
                f"{{role, content}} messages, got {type(prompt).__name__}"
            )
        if answer is None:
            raise ValueError(f"{self.origin} row {index}: {self.config.answer_key!r} is empty; every prompt needs a reference answer")
        return messages, str(answer)


def read_parquet(path: Path) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path).to_pylist()
    except Exception as exc:  # pyarrow raises several unrelated types for a bad file
        raise ValueError(f"{path}: not a readable Parquet file ({exc.__class__.__name__}: {exc})") from None


def read_hf(path: str, split: str) -> list[dict]:
    try:
        import datasets
    except ImportError:
        raise ValueError("data.source='hf' needs the `datasets` package (pip install datasets)") from None
    if Path(path).is_dir():
        data = datasets.load_from_disk(path)
    else:
        data = datasets.load_dataset(path, split=split, download_mode="reuse_cache_if_exists")
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"data.path={path!r}: no split {split!r} (splits: {', '.join(data)}); set data.split")
        data = data[split]
    return data.to_list()


class PromptSource:
    """The job's prompts, step by step. `split="eval"` gives a built-in task's held-out items, none of
    which the train split (the default) ever yields; their prompt ids start with `e` instead of `s`."""

    def __init__(self, config: DataConfig, seed: int, split: Literal["train", "eval"] = "train"):
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r}: use 'train' or 'eval'")
        self.config, self.seed, self.split = config, seed, split
        if config.source in TASKS:
            task = TASKS[config.source](getattr(config, config.source))
            self.dataset = GeneratedTask(task, seed, split, config.source)
        elif split == "eval":
            raise ValueError(
                f"split='eval' is generated for the built-in tasks ({', '.join(TASKS)}) only; data.source="
                f"{config.source!r} has no held-out rows: give the eval prompts their own file"
            )
        else:
            path = Path(config.path)
            if config.source != "hf" and not path.is_file():
                raise FileNotFoundError(f"data.path={config.path!r}: no such file")
            rows = {"jsonl": read_jsonl, "parquet": read_parquet}[config.source](path) if config.source != "hf" \
                else read_hf(config.path, config.split)
            self.dataset = TableDataset(rows, config, config.path)
            for i in range(len(rows)):  # fail now, not at step 300
                self.dataset.item(i)
        self._perms: dict[int, list[int]] = {}

    def _row(self, index: int) -> int:
        n = self.dataset.size
        if n is None:
            return index
        epoch, offset = divmod(index, n)
        if not self.config.shuffle:
            return offset
        if epoch not in self._perms:
            order = list(range(n))
            random.Random(stable_seed(self.seed, epoch, 1)).shuffle(order)
            self._perms = {epoch: order}
        return self._perms[epoch][offset]

    def batch(self, step: int, size: int) -> list[PromptRecord]:
        return [self._record(f"{'s' if self.split == 'train' else 'e'}{step}-p{i}", step * size + i) for i in range(size)]

    def spares(self, step: int, size: int) -> list[PromptRecord]:
        """Prompts a partial-rollout job keeps in flight beyond a step's batch, queued with step `step` (the first
        one after a start or a rollback): rows from a stream of their own (ids x<step>-p<i>), so every batch's
        prompts are still dispatched in order."""
        return [self._record(f"x{step}-p{i}", SPARE_INDEX + step * size + i) for i in range(size)]

    def _record(self, prompt_id: str, index: int) -> PromptRecord:
        messages, answer = self.dataset.item(self._row(index))
        if self.config.system_prompt:
            messages = [{"role": "system", "content": self.config.system_prompt}] + messages
        return PromptRecord(prompt_id, tuple(messages), answer, index)


def eval_prompts(config: DataConfig, seed: int) -> list[PromptRecord]:
    """The held-out prompts of `data.eval`: a built-in task's eval split, or the first rows of `eval.path`."""
    if config.eval.path is None:
        return PromptSource(config, seed, split="eval").batch(0, config.eval.prompts)
    source = PromptSource(config.model_copy(update={"path": config.eval.path, "shuffle": False}), seed)
    return [replace(r, prompt_id="e" + r.prompt_id[1:]) for r in source.batch(0, min(config.eval.prompts, source.dataset.size))]


def render_prompt(tokenizer, messages, chat_template: bool) -> list[int]:
    """Token ids of a prompt: the chat template with the generation prompt, or the plain text."""
    if chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("data.chat_template=true but the tokenizer has no chat template; set data.chat_template=false")
        ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    else:
        ids = tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]
    return [int(i) for i in ids]
