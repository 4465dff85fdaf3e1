"""`EngineSettings`: the config fields every rollout engine shares — its sparse layout and its first schedule.

One definition, so the native and vLLM engines validate `dense_layers`, `sink`, `recent` and the
landmark mode the same way (`sparrow.layout`) and build the same layout from them.
"""

from pydantic import Field

from sparrow.layout import SparseLayoutSettings


class EngineSettings(SparseLayoutSettings):
    schedule: str | None = Field(None, description="initial sparsity schedule (name or file); None = dense")
