"""The block-sparse layout every component shares, defined once.

A layout is the unit and the fixed part of Sparrow's block selection: KV blocks of `block_size` tokens,
the first `sink` and last `recent` blocks of a row always attended, the layers in `dense_layers` never
sparse, and the block summary the top-k is scored against (`landmark`). The kernels, both rollout
engines, the trainer's sparse forward and the sparsity schedules all read it from here: a schedule's
budgets count blocks of a layout, so `check_compatible` refuses a schedule written for another one.
Its config fields are `sparrow.layout_settings` (this module needs nothing beyond the standard library,
so the kernels import it on a bare GPU machine).
"""

from dataclasses import dataclass, field
from typing import Literal, get_args

BLOCK_SIZE = 16
"""Tokens per KV block, Sparrow's sparsity unit. The Triton kernels and the vLLM page layout are built for it."""

LandmarkMode = Literal["mean", "minmax", "mean_int8"]
"""The block summary: the mean key (Sparrow), Quest's channel-wise max ‖ min, or the mean key stored as int8 with
one float32 scale (144 bytes a row at D = 128, 0.56 of a bfloat16 mean key's 256: the landmark scan moves about half
as much)."""
LANDMARK_MODES = get_args(LandmarkMode)
INT8_ROW_ALIGN = 16
"""A `mean_int8` row: D int8 values, the 4 bytes of their float32 scale, zero bytes up to a multiple of 16 bytes, so
every row starts 16-byte aligned and the scoring kernel reads it in 16-byte loads."""

KVCacheDType = Literal["auto", "fp8_e4m3"]
"""How K/V pages store values: auto = the model's dtype; fp8_e4m3 = e4m3 with a float32 scale per stored vector
(`sparrow.kernels.reference.kv_quant`). Here, beside the page geometry, so option parsers need no torch."""
KV_CACHE_DTYPES = get_args(KVCacheDType)

SCHEDULE_FIELDS = ("block_size", "sink", "recent")
"""The layout fields a sparsity schedule records, because its budgets depend on them."""


class ScheduleError(ValueError):
    """A schedule that cannot be used — malformed, or written for another layout — with the field, the
    value and the fix in the message. Defined with the layout, which refuses schedules of other layouts."""


def selection_problem(block_size, sink, recent) -> str | None:
    """What is wrong with a layout's block size, sink and recent (None when nothing is): the rule both
    layouts and schedules are validated by."""
    for name, value in zip(SCHEDULE_FIELDS, (block_size, sink, recent)):
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{name}={value!r} must be an integer"
    if block_size < 1:
        return f"block_size={block_size} must be >= 1 (Sparrow uses {DEFAULT_LAYOUT.block_size})"
    if sink < 0:
        return f"sink={sink} must be >= 0 (Sparrow uses {DEFAULT_LAYOUT.sink})"
    if recent < 1:
        return (f"recent={recent} must be >= 1: the partial current block has no landmark and is always attended "
                f"(Sparrow uses {DEFAULT_LAYOUT.recent})")
    return None


@dataclass(frozen=True)
class SparseAttentionConfig:
    """Selection rule for one model.

    `block_size` tokens form a block (the sparsity unit). A row (sequence, KV head) always keeps its
    first `sink` blocks and its last `recent` blocks (the last one is the partial current block);
    the rest of the budget is the exact top-k of the remaining blocks by landmark score. Layers in
    `dense_layers` always attend densely. `landmark` picks the block summary: the mean key (Sparrow),
    the Quest channel-wise min/max, or the mean key in int8 (`LandmarkMode`).
    """

    block_size: int = BLOCK_SIZE
    sink: int = 1
    recent: int = 2
    dense_layers: tuple[int, ...] = field(default=(0, 1))
    landmark: LandmarkMode = "mean"

    def __post_init__(self):
        problem = selection_problem(self.block_size, self.sink, self.recent)
        if problem:
            raise ValueError(problem)
        if self.landmark not in LANDMARK_MODES:
            raise ValueError(f"landmark={self.landmark!r}: use one of {', '.join(LANDMARK_MODES)}")
        object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))

    @classmethod
    def of_schedule(cls, schedule, **layers) -> "SparseAttentionConfig":
        """The layout a schedule was written for (its block size, sink and recent; the default layout
        for None), with `dense_layers` / `landmark` from `layers`."""
        if schedule is None:
            return cls(**layers)
        return cls(**{name: getattr(schedule, name) for name in SCHEDULE_FIELDS}, **layers)

    @property
    def reserved_blocks(self) -> int:
        return self.sink + self.recent

    def landmark_width(self, head_dim: int) -> int:
        """Elements stored per (block, KV head): the mean key (D), max ‖ min (2·D), or a `mean_int8` row of bytes (D
        values, a float32 scale, padding: `INT8_ROW_ALIGN`; D a multiple of 4)."""
        if self.landmark == "mean_int8":
            if head_dim % 4:
                raise ValueError(f"landmark=mean_int8 needs a head_dim that is a multiple of 4, not {head_dim}: use mean")
            return -(-(head_dim + 4) // INT8_ROW_ALIGN) * INT8_ROW_ALIGN
        return head_dim if self.landmark == "mean" else 2 * head_dim

    def landmark_bytes(self, head_dim: int, itemsize: int) -> int:
        """Bytes stored per (block, KV head) with activations of `itemsize` bytes (int8 landmarks: one byte each)."""
        return self.landmark_width(head_dim) * (1 if self.landmark == "mean_int8" else itemsize)

    def is_dense_layer(self, layer: int) -> bool:
        return layer in self.dense_layers

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def check_layers(self, num_layers: int, key: str = "dense_layers") -> None:
        """Refuse dense layers the model does not have; `key` names the setting in the message."""
        missing = [i for i in self.dense_layers if i >= num_layers]
        if missing:
            raise ValueError(f"{key}={list(self.dense_layers)}: layers {missing} do not exist (the model has {num_layers})")

    def check_compatible(self, schedule, schedule_key: str | None = None, layout_key: str | None = None) -> None:
        """Raise `ScheduleError` unless `schedule` counts blocks of this layout (same block size, sink and
        recent). `schedule_key` / `layout_key` name the config keys of both sides in the message (default:
        the schedule by name, and "the engine")."""
        if schedule is None:
            return
        for name in SCHEDULE_FIELDS:
            theirs, ours = getattr(schedule, name), getattr(self, name)
            if theirs == ours:
                continue
            if name == "block_size":
                mine = f"the KV blocks are {ours} tokens (block_size is fixed: sparrow.layout.BLOCK_SIZE)"
            elif layout_key:
                mine = f"{layout_key}.{name}={ours}"
            else:
                mine = f"the engine uses {name}={ours}"
            raise ScheduleError(f"{schedule_key or f'schedule {schedule.name!r}'} has {name}={theirs} but {mine}; make them equal")


DEFAULT_LAYOUT = SparseAttentionConfig()
"""Sparrow's layout: blocks of 16 tokens, sink 1, recent 2, layers 0 and 1 dense, mean-key landmarks."""
