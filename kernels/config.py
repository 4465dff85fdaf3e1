"""The knobs of Sparrow's block-sparse decode attention, shared by every backend."""

from dataclasses import dataclass, field
from typing import Literal

LandmarkMode = Literal["mean", "minmax"]


@dataclass(frozen=True)
class SparseAttentionConfig:
    """Selection rule for one model.

    `block_size` tokens form a block (the sparsity unit). A row (sequence, KV head) always keeps its
    first `sink` blocks and its last `recent` blocks (the last one is the partial current block);
    the rest of the budget is the exact top-k of the remaining blocks by landmark score. Layers in
    `dense_layers` always attend densely. `landmark` picks the block summary: the mean key (Sparrow)
    or the Quest channel-wise min/max.
    """

    block_size: int = 16
    sink: int = 1
    recent: int = 2
    dense_layers: tuple[int, ...] = field(default=(0, 1))
    landmark: LandmarkMode = "mean"

    def __post_init__(self):
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size}: must be >= 1")
        if self.sink < 0:
            raise ValueError(f"sink={self.sink}: must be >= 0")
        if self.recent < 1:
            raise ValueError(
                f"recent={self.recent}: must be >= 1 so the partial current block, which has no "
                "landmark yet, is always attended"
            )
        if self.landmark not in ("mean", "minmax"):
            raise ValueError(f"landmark={self.landmark!r}: use 'mean' or 'minmax'")
        object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))

    @property
    def reserved_blocks(self) -> int:
        return self.sink + self.recent

    def landmark_width(self, head_dim: int) -> int:
        """Floats stored per (block, KV head): the mean key, or max ‖ min."""
        return head_dim if self.landmark == "mean" else 2 * head_dim

    def is_dense_layer(self, layer: int) -> bool:
        return layer in self.dense_layers
