"""`SparseLayoutSettings`: the block-sparse layout fields every rollout engine's config shares.

One definition, so the native and vLLM engines validate `dense_layers`, `sink`, `recent` and the
landmark mode the same way and build the same `SparseAttentionConfig` from them.
"""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sparrow.kernels import SparseAttentionConfig


class SparseLayoutSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dense_layers: tuple[int, ...] = Field(
        (0, 1), description="layers that always decode densely (Sparrow: 0, 1); on vLLM they run its stock attention"
    )
    landmark: Literal["mean", "minmax"] = Field("mean", description="block summary: mean key (Sparrow) or min/max (Quest)")
    sink: int = Field(1, ge=0, description="first blocks always attended")
    recent: int = Field(2, ge=1, description="last blocks always attended (the partial current block included)")
    schedule: str | None = Field(None, description="initial sparsity schedule (name or file); None = dense")

    @field_validator("dense_layers")
    @classmethod
    def _dense_layers(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(i < 0 for i in value):
            raise ValueError(f"dense_layers={list(value)}: layer indices must be >= 0")
        return tuple(sorted(set(value)))

    def sparse_attention(self) -> SparseAttentionConfig:
        return SparseAttentionConfig(
            block_size=16, sink=self.sink, recent=self.recent, dense_layers=self.dense_layers, landmark=self.landmark
        )
