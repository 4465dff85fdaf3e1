"""Sparsity schedules: how many KV blocks a sequence attends to, as a function of its total length.

A schedule divides the total length L (prompt + generated so far, the token being decoded included)
into bins at token `edges`; each bin has a number of top-k blocks (Sparrow's table value). A row
attends to `topk + sink + recent` blocks, and densely when its ceil(L / block_size) blocks fit in
that. The bin of L is the number of edges e with ceil(L / block_size)·block_size ≥ e, which with
edges at multiples of 2000 reproduces Sparrow's `min(ceil(L/16) // 125, 19)` exactly.
A bin whose value is None is dense.

torch is not imported here (the vectorised methods build their tensors from the lengths they are
given) and yaml only for schedule files, so `sparrow schedule list` starts fast.
"""

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from sparrow.layout import DEFAULT_LAYOUT, ScheduleError, selection_problem

__all__ = ["DENSE_BUDGET", "SPARROW_EDGES", "ScheduleError", "SparsitySchedule", "load_schedule", "published_schedules"]

DENSE_BUDGET = 1 << 30
"""Budget (in blocks) standing for 'attend to everything' in tensors of budgets."""

SPARROW_EDGES = tuple(range(2000, 40000, 2000))


@dataclass(frozen=True)
class SparsitySchedule:
    """Top-k blocks per length bin. `block_size`, `sink` and `recent` record the layout (`sparrow.layout`)
    whose blocks the budgets count; a layout refuses a schedule of another one (`check_compatible`)."""

    name: str
    topk_blocks: tuple[int | None, ...]
    edges: tuple[int, ...] = SPARROW_EDGES
    sink: int = DEFAULT_LAYOUT.sink
    recent: int = DEFAULT_LAYOUT.recent
    block_size: int = DEFAULT_LAYOUT.block_size
    version: int = 0
    source: str = ""
    notes: tuple[str, ...] = field(default=())

    def __post_init__(self):
        object.__setattr__(self, "topk_blocks", tuple(self.topk_blocks))
        object.__setattr__(self, "edges", tuple(self.edges))
        object.__setattr__(self, "notes", tuple(self.notes))
        self.validate()

    def validate(self) -> None:
        where = f"schedule {self.name!r}"
        problem = selection_problem(self.block_size, self.sink, self.recent)
        if problem:
            raise ScheduleError(f"{where}: {problem}")
        if not isinstance(self.version, int) or isinstance(self.version, bool):
            raise ScheduleError(f"{where}: version={self.version!r} must be an integer")
        if self.version < 0:
            raise ScheduleError(f"{where}: version={self.version} must be >= 0")
        for i, e in enumerate(self.edges):
            if not isinstance(e, int) or isinstance(e, bool) or e <= 0:
                raise ScheduleError(f"{where}: edges[{i}]={e!r} must be a positive integer token count")
            if i and e <= self.edges[i - 1]:
                raise ScheduleError(
                    f"{where}: edges[{i}]={e} must be greater than edges[{i - 1}]={self.edges[i - 1]} "
                    "(edges are increasing token lengths)"
                )
        if len(self.topk_blocks) != len(self.edges) + 1:
            raise ScheduleError(
                f"{where}: topk_blocks has {len(self.topk_blocks)} values but {len(self.edges)} edges "
                f"define {len(self.edges) + 1} bins; give one value per bin"
            )
        for i, v in enumerate(self.topk_blocks):
            if v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ScheduleError(
                    f"{where}: topk_blocks[{i}]={v!r} must be an integer >= 0 (top-k blocks besides "
                    "sink and recent) or null for dense"
                )

    @property
    def is_dense(self) -> bool:
        """Every bin attends the whole context (the job's dense schedule: bins for α, no budget)."""
        return all(v is None for v in self.topk_blocks)

    @property
    def num_bins(self) -> int:
        return len(self.topk_blocks)

    def bin_of(self, length: int) -> int:
        """Bin index of total length `length` (tokens)."""
        aligned = math.ceil(length / self.block_size) * self.block_size
        return sum(1 for e in self.edges if aligned >= e)

    def bin_range(self, index: int) -> tuple[int, int | None]:
        """Inclusive token range [lo, hi] of a bin (hi None for the last)."""
        bs = self.block_size
        lo = 1 if index == 0 else (math.ceil(self.edges[index - 1] / bs) - 1) * bs + 1
        hi = None if index == len(self.edges) else (math.ceil(self.edges[index] / bs) - 1) * bs
        return lo, hi

    def bin_text(self, index: int) -> str:
        """A bin's token range for tables: "lo-hi", or ">= lo" for the last bin."""
        lo, hi = self.bin_range(index)
        return f"{lo}-{hi}" if hi is not None else f">= {lo}"

    def blocks_for_bin(self, index: int) -> int | None:
        """Blocks attended per row in a bin, sinks and recents included; None = dense."""
        v = self.topk_blocks[index]
        return None if v is None else v + self.sink + self.recent

    def blocks_attended(self, length: int) -> int | None:
        """Blocks a row of total length `length` attends to, or None when attention is dense there."""
        blocks = math.ceil(length / self.block_size)
        budget = self.blocks_for_bin(self.bin_of(length))
        return None if budget is None or blocks <= budget else budget

    def bins_for_lengths(self, lengths: "torch.Tensor") -> "torch.Tensor":
        """Vectorised `bin_of`: the bin index per total length, on the lengths' device."""
        lengths = lengths.long()
        aligned = (lengths + self.block_size - 1) // self.block_size * self.block_size
        return (aligned[..., None] >= aligned.new_tensor(self.edges)).sum(-1)

    def budgets_for_lengths(self, lengths: "torch.Tensor") -> "torch.Tensor":
        """Vectorised budget (total blocks) per length; dense bins give DENSE_BUDGET."""
        bins = self.bins_for_lengths(lengths)
        table = bins.new_tensor([DENSE_BUDGET if b is None else b for b in map(self.blocks_for_bin, range(self.num_bins))])
        return table[bins]

    def budget_by_blocks(self, max_blocks: int) -> "torch.Tensor":
        """Budget (blocks) of a row by its block count ceil(L / block_size) = 0..max_blocks: a row's budget depends on
        that count only, so a batch's budgets are one lookup (on the host, or on the device with nothing built or
        copied per step)."""
        import torch

        return self.budgets_for_lengths(torch.arange(max_blocks + 1) * self.block_size)

    def query_budgets(self, prompt_len: int, num_tokens: int) -> "torch.Tensor":
        """`[num_tokens]` budget of the query at each position of a sequence, as rollouts run them: dense at
        prompt positions (prefill, and the pass that samples the first response token), the schedule's at
        context L = i + 1 after them."""
        import torch

        budgets = torch.full((num_tokens,), DENSE_BUDGET, dtype=torch.long)
        budgets[prompt_len:] = self.budgets_for_lengths(torch.arange(prompt_len, num_tokens) + 1)
        return budgets

    @classmethod
    def fixed_budget(cls, blocks: int, what: str = "budget") -> "SparsitySchedule":
        """`blocks` total blocks per query at every length, the default layout's sink + recent included: the
        benchmarks' schedule. `what` names the value in the error (a CLI flag)."""
        reserved = DEFAULT_LAYOUT.reserved_blocks
        if blocks < reserved:
            raise ScheduleError(f"{what}={blocks}: must be >= {reserved}, the sink + recent blocks every query keeps")
        return cls(name=f"budget-{blocks}", topk_blocks=(blocks - reserved,), edges=())

    def with_topk(self, topk_blocks, version: int | None = None, name: str | None = None) -> "SparsitySchedule":
        return replace(
            self,
            topk_blocks=tuple(topk_blocks),
            version=self.version + 1 if version is None else version,
            name=self.name if name is None else name,
        )

    def to_dict(self) -> dict:
        d = asdict(self)
        d["topk_blocks"] = list(self.topk_blocks)
        d["edges"] = list(self.edges)
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, data: dict, origin: str = "schedule") -> "SparsitySchedule":
        if not isinstance(data, dict):
            raise ScheduleError(f"{origin}: expected a mapping with keys name, topk_blocks, ... got {type(data).__name__}")
        allowed = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ScheduleError(f"{origin}: unknown key(s) {unknown}; allowed keys are {sorted(allowed)}")
        if "topk_blocks" not in data:
            raise ScheduleError(f"{origin}: missing key 'topk_blocks' (one top-k block count per length bin)")
        data = dict(data)
        data.setdefault("name", Path(origin).stem)
        if not isinstance(data["topk_blocks"], (list, tuple)):
            raise ScheduleError(f"{origin}: topk_blocks={data['topk_blocks']!r} must be a list")
        if "edges" in data and not isinstance(data["edges"], (list, tuple)):
            raise ScheduleError(f"{origin}: edges={data['edges']!r} must be a list of token lengths")
        return cls(**data)

    def save(self, path: str | Path) -> None:
        import yaml

        path = Path(path)
        text = yaml.safe_dump(self.to_dict(), sort_keys=False) if path.suffix in (".yaml", ".yml") else json.dumps(self.to_dict(), indent=1)
        path.write_text(text)


def published_schedules() -> dict[str, SparsitySchedule]:
    """Every table of the Sparrow code release, with Sparrow's exact semantics."""
    raw = json.loads(resources.files("sparrow").joinpath("data/published_schedules.json").read_text())
    return {
        name: SparsitySchedule(name=name, topk_blocks=tuple(values), source=raw["source"])
        for name, values in raw["schedules"].items()
    }


def load_schedule(source: str | Path | Mapping, origin: str = "inline schedule") -> SparsitySchedule:
    """A published schedule by name, a JSON/YAML schedule file, or a schedule's mapping (`to_dict`'s form, named
    `origin` in errors: how a job hands its engines the schedule in force when they start)."""
    if isinstance(source, Mapping):
        return SparsitySchedule.from_dict(dict(source), origin=origin)
    text = str(source)
    tables = published_schedules()
    if text in tables:
        return tables[text]
    path = Path(text)
    if not path.exists():
        raise ScheduleError(
            f"schedule {text!r}: not a published schedule name and no such file; "
            f"run `sparrow schedule list` for names (e.g. qwen3-1.7b-0.86) or give a .json/.yaml path"
        )
    import yaml

    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ScheduleError(f"{path}: not valid JSON/YAML ({exc.__class__.__name__}: {str(exc).splitlines()[0]})") from None
    return SparsitySchedule.from_dict(data, origin=str(path))
