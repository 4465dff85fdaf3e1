"""`EngineSettings`: the config fields and job rules every rollout engine shares.

One definition, so the native and vLLM engines validate `dense_layers`, `sink`, `recent` and the
landmark mode the same way (`sparrow.layout`), build the same layout from them, and refuse the same
jobs they cannot run; an engine's config adds its own rules by extending `check_job`.
"""

from typing import Any, ClassVar

from pydantic import Field

from sparrow.layout import KVCacheDType
from sparrow.layout_settings import SparseLayoutSettings
from sparrow.schedule import SparsitySchedule

from .api import SamplingParams


class EngineSettings(SparseLayoutSettings):
    releases_memory: ClassVar[bool] = False
    """The engine implements `sleep` / `wake` (a colocated placement needs it)."""

    interrupts: ClassVar[bool] = False
    """The engine implements `interrupt` (partial rollouts need it)."""

    def how_to_release_memory(self, section: str, name: str) -> str:
        """What a user changes when a colocated job needs `releases_memory` and this engine lacks it."""
        return f"{section}.engine={name!r} cannot: use run.placement='disaggregated'"

    def dense_only(self, section: str, name: str) -> str | None:
        """Why this engine, as set, attends densely whatever the schedule (a job then runs the dense schedule and no
        controller), naming the setting; None when its layers follow a schedule."""
        return None

    max_num_seqs: int = Field(64, ge=1, description="sequences decoded together (a GRPO group counts n)")
    schedule: str | dict[str, Any] | None = Field(
        None, description="initial sparsity schedule (name, file, or inline mapping); None = dense. In a job the "
        "worker sets it to the job's schedule in force (rollout.schedule), so an engine that fixes its kernels when it "
        "starts (vLLM's full decode graphs) starts with the job's")
    kv_cache_dtype: KVCacheDType = Field(
        "auto",
        description="K/V pages: auto = the model's dtype; fp8_e4m3 (native engine) = e4m3 with one float32 scale per stored vector "
        "(0.53x bfloat16's bytes per token with the landmarks at Qwen3-1.7B's shape: ~1.9x the sequences per GPU), "
        "read by every attention (prefill included); on CUDA it needs compute capability 8.9+ (Ada, Hopper). The "
        "job's one setting of it: the trainer's sparse forward reads K/V as the engines store them",
    )

    def check_job(self, sampling: SamplingParams, schedule: SparsitySchedule, section: str, name: str) -> None:
        """Raise ValueError if this engine cannot run a job whose requests all use `sampling` under `schedule`.

        The engine's settings sit at `{section}.{name}` of the job config, next to `{section}.sampling`,
        `{section}.schedule` and `{section}.engine`; the messages name those dotted keys.
        """
        if sampling.n > self.max_num_seqs:
            raise ValueError(
                f"{section}.sampling.n={sampling.n} exceeds {section}.{name}.max_num_seqs={self.max_num_seqs}; "
                "raise max_num_seqs or lower n"
            )
        self.layout().check_compatible(schedule, f"{section}.schedule", f"{section}.{name}")
