"""Prompt sources: the built-in arithmetic task, JSONL and Parquet files, and local `datasets` datasets.

Every source is addressed by a global index, and the prompts of step k are indices
[k·P, (k+1)·P) (P = prompts per step): the data order is a pure function of (seed, step), so
resuming at a step needs no saved cursor or RNG state. Finite datasets are reshuffled every epoch
(a seeded permutation); the arithmetic task is infinite.
"""

import random
from dataclasses import dataclass
from pathlib import Path

from sparrow.jsonl import read_jsonl
from sparrow.seeds import stable_seed

from .config import ArithmeticConfig, DataConfig


@dataclass(frozen=True)
class PromptRecord:
    """One prompt as the rollout workers receive it: chat messages plus what its reward needs."""

    prompt_id: str
    messages: tuple[dict, ...]
    answer: str
    index: int = 0
    """Global index in the source (for tracing a sample back to its data)."""


def evaluate(values: list[int], ops: list[str]) -> int:
    """`values[0] ops[0] values[1] ...` with * before + and -."""
    terms, signs = [values[0]], []
    for op, v in zip(ops, values[1:]):
        if op == "*":
            terms[-1] *= v
        else:
            terms.append(v)
            signs.append(1 if op == "+" else -1)
    return terms[0] + sum(s * t for s, t in zip(signs, terms[1:]))


class ArithmeticTask:
    """Integer expressions such as `17 - 4 + 9`; the exact answer is Python's evaluation."""

    def __init__(self, config: ArithmeticConfig, seed: int):
        self.config, self.seed = config, seed

    size = None
    """Infinite: every index is a new problem."""

    def problem(self, index: int) -> tuple[str, int]:
        c = self.config
        rng = random.Random(stable_seed(self.seed, index))
        values = [rng.randint(c.min_value, c.max_value) for _ in range(c.terms)]
        ops = [rng.choice(c.operations) for _ in range(c.terms - 1)]
        expression = " ".join([str(values[0])] + [f"{op} {v}" for op, v in zip(ops, values[1:])])
        return expression.replace("+ -", "- ").replace("- -", "+ "), evaluate(values, ops)

    def item(self, index: int) -> tuple[list[dict], str]:
        expression, answer = self.problem(index)
        return [{"role": "user", "content": self.config.template.replace("{expression}", expression)}], str(answer)


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

    def item(self, index: int) -> tuple[list[dict], str]:
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
    """The job's prompts, step by step."""

    def __init__(self, config: DataConfig, seed: int):
        self.config, self.seed = config, seed
        if config.source == "arithmetic":
            self.dataset = ArithmeticTask(config.arithmetic, seed)
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
        records = []
        for i in range(size):
            index = step * size + i
            messages, answer = self.dataset.item(self._row(index))
            if self.config.system_prompt:
                messages = [{"role": "system", "content": self.config.system_prompt}] + messages
            records.append(PromptRecord(f"s{step}-p{i}", tuple(messages), answer, index))
        return records


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
