"""The config fields of the sparse layout (`sparrow.layout`), shared by the rollout engines' sections
(`EngineSettings`) and the trainer's DistillSparse section: one definition of their defaults, ranges
and descriptions, and of the layout they set."""

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sparrow.layout import DEFAULT_LAYOUT, LandmarkMode, SparseAttentionConfig


class SparseLayerSettings(BaseModel):
    """Config fields of the layers' part of a layout (which layers stay dense, the block summary)."""

    model_config = ConfigDict(extra="forbid")

    dense_layers: tuple[int, ...] = Field(DEFAULT_LAYOUT.dense_layers, description="layers that always attend densely (Sparrow: 0, 1)")
    landmark: LandmarkMode = Field(DEFAULT_LAYOUT.landmark, description="block summary: mean key (Sparrow), min/max (Quest), or mean_int8: the mean key in int8 with a float32 scale per (block, KV head), half the bytes the landmark scan reads (native engine)")

    @field_validator("dense_layers")
    @classmethod
    def _dense_layers(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(i < 0 for i in value):
            raise ValueError(f"dense_layers={list(value)}: layer indices must be >= 0")
        return tuple(sorted(set(value)))

    def layout_for(self, schedule) -> SparseAttentionConfig:
        """These layers with the block size, sink and recent of `schedule` (the default layout's for None)."""
        return SparseAttentionConfig.of_schedule(schedule, dense_layers=self.dense_layers, landmark=self.landmark)


class SparseLayoutSettings(SparseLayerSettings):
    """Config fields of a whole layout (the block size is fixed); `layout()` is the layout they set."""

    sink: int = Field(DEFAULT_LAYOUT.sink, ge=0, description="first blocks always attended")
    recent: int = Field(DEFAULT_LAYOUT.recent, ge=1, description="last blocks always attended (the partial current block included)")

    def layout(self) -> SparseAttentionConfig:
        return SparseAttentionConfig(sink=self.sink, recent=self.recent, dense_layers=self.dense_layers, landmark=self.landmark)
