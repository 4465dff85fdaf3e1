"""`VllmEngineConfig`: the vLLM rollout engine's section of the Sparrow config (no vLLM import)."""

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from sparrow.layout import BLOCK_SIZE
from sparrow.schedule import SparsitySchedule

from ..api import SamplingParams
from ..engine_settings import EngineSettings

GiB = 1 << 30


class VllmEngineConfig(EngineSettings):
    """Everything `VllmEngine` needs besides the requests.

    `kv_cache_memory_bytes` is the whole per-worker budget: vLLM's KV pages plus the landmark side
    tables of the sparse layers, split between them by `split_kv_budget`. Defaults that depend on
    the platform (`None`) resolve to what works there: CPU → float32, pages of 32 tokens (vLLM's
    CPU attention needs multiples of 32), eager mode; CUDA → bfloat16, pages of 16, CUDA graphs.
    """

    model: str | None = Field(None, description="HF model directory (Qwen3 or Llama architecture)")
    attention: Literal["sparrow", "stock"] = Field(
        "sparrow", description="sparrow = dense_layers on vLLM's backend, the rest block-sparse; stock = vLLM as is (always dense)"
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="auto = float32 on CPU, bfloat16 on CUDA")
    tensor_parallel_size: int = Field(1, ge=1)
    max_model_len: int | None = Field(None, ge=2, description="prompt + generated tokens; None = model maximum")
    block_size: int | None = Field(
        None, description=f"vLLM page size in tokens, a multiple of {BLOCK_SIZE}; None = {2 * BLOCK_SIZE} on CPU, {BLOCK_SIZE} on CUDA"
    )
    kv_cache_memory_bytes: int = Field(GiB, ge=1 << 20, description="per worker: KV pages + landmark side tables")
    enable_prefix_caching: bool = True
    enforce_eager: bool | None = Field(None, description="None = eager on CPU, CUDA graphs on CUDA (see cuda_graphs)")
    cuda_graphs: Literal["auto", "piecewise", "full_decode"] = Field(
        "auto", description="piecewise = vLLM's graphs between the sparse layers, which run eagerly; full_decode = a "
                            "decode-only step replays one graph of the whole model, sparse layers included (CUDA, "
                            "pages of 16 tokens, Triton kernels; matches the native engine on an H100, and after a "
                            "sleep, a wake and a new version; in a one-step job on an H100 the rollout ran 1.8x "
                            "(dense) and 2.7x (sparse) faster than piecewise). An engine started dense with "
                            "full_decode stays dense (a job starts its engines with the job's schedule). auto = "
                            "full_decode where it can capture (CUDA graphs on, sparrow attention, Triton kernels, "
                            "pages of 16, no trace, a schedule given at start), piecewise otherwise"
    )
    attention_backend: Literal["auto", "reference", "triton"] = Field(
        "auto", description="sparse decode kernels; auto = triton on CUDA, reference (torch) on CPU"
    )
    max_logprobs: int = Field(20, ge=0, description="the most top-k logprobs a request may ask for")
    seed: int = Field(0, description="engine seed; also draws the seeds of requests that give none")
    weight_update: Literal["auto", "memory", "reload", "recreate"] = Field(
        "auto", description="how a state dict reaches vLLM: memory = loaded in place from shared buffers vLLM's worker "
                            "maps (no disk); reload = written as a checkpoint, then loaded in place (reload_weights); "
                            "recreate = vLLM restarted on that checkpoint (~20 s on CPU even for a tiny model); "
                            "auto = memory on CPU, reload on GPU. memory publishes faster (a 2.83 GB version in a job "
                            "step on an H100: 0.6-0.7 s, reload 3.8-4.2 s); a state dict not read from a colocated "
                            "trainer's shared buffers is copied into the engine's own, one more copy of the weights on "
                            "the device. On CPU the packed GEMM copies are re-packed after an in-place load"
    )
    weight_transfer_backend: str | None = Field(
        None, description="vLLM native weight transfer for trainer pushes, e.g. 'nccl' (GPU only)"
    )
    sleep_mode: bool = Field(
        False, description="start vLLM with its sleep mode (CUDA only), so sleep()/wake() give the GPU back between "
        "steps: what run.placement=colocated needs"
    )
    trace_steps: int = Field(0, ge=0, description="keep the last N decode steps' blocks attended (tests, debugging)")
    engine_args: dict[str, Any] = Field(default_factory=dict, description="extra vllm AsyncEngineArgs (escape hatch)")

    interrupts: ClassVar[bool] = True

    @property
    def releases_memory(self) -> bool:
        """`sleep` / `wake` work only on an engine started in vLLM's sleep mode."""
        return self.sleep_mode

    def full_decode_graphs(self, graphs_on: bool, schedule_at_start: bool) -> bool:
        """Whether decode steps replay full graphs with the sparse layers inside: as asked, or under `auto` where
        they can be captured and a schedule given at start lets the engine switch schedules later."""
        if not graphs_on or self.attention != "sparrow":
            return False
        if self.cuda_graphs != "auto":
            return self.cuda_graphs == "full_decode"
        return (schedule_at_start and self.attention_backend != "reference" and self.trace_steps == 0
                and self.block_size in (None, BLOCK_SIZE))

    def how_to_release_memory(self, section: str, name: str) -> str:
        return f"set {section}.{name}.sleep_mode=true (CUDA only), or use run.placement='disaggregated'"

    def dense_only(self, section: str, name: str) -> str | None:
        if self.attention == "stock":
            return f"{section}.{name}.attention='stock' runs vLLM's own layers, which attend densely"
        return None

    def check_job(self, sampling: SamplingParams, schedule: SparsitySchedule, section: str, name: str) -> None:
        """The shared rules, and vLLM's: unfiltered logprobs (no top-p / top-k), enough top-k logprobs, and stock
        attention only under the dense schedule."""
        super().check_job(sampling, schedule, section, name)
        dense = self.dense_only(section, name)
        if dense and not schedule.is_dense:
            raise ValueError(f"{section}.schedule={schedule.name!r}: {dense}; set {section}.schedule=dense, or "
                             f"{section}.{name}.attention='sparrow' for sparse rollouts")
        if sampling.top_p != 1.0 or sampling.top_k != 0:
            raise ValueError(
                f"{section}.sampling.top_p/top_k: the vLLM backend returns renormalised logprobs under top-p/top-k; "
                f"leave top_p=1 and top_k=0 with {section}.engine={name!r}"
            )
        if self.max_logprobs < sampling.logprobs:
            raise ValueError(
                f"{section}.sampling.logprobs={sampling.logprobs} exceeds {section}.{name}.max_logprobs={self.max_logprobs}"
            )

    @model_validator(mode="after")
    def _memory_updates_one_worker(self) -> "VllmEngineConfig":
        if self.weight_update == "memory" and self.tensor_parallel_size > 1:
            raise ValueError(f"weight_update='memory' with tensor_parallel_size={self.tensor_parallel_size}: the "
                             "shared buffers are mapped by one worker on the engine's own device; use "
                             "weight_update='reload' (or 'auto') with tensor parallelism")
        return self

    @model_validator(mode="after")
    def _stock_attention_is_dense(self) -> "VllmEngineConfig":
        if self.attention == "stock" and self.schedule is not None:
            raise ValueError(f"schedule={self.schedule!r} with attention='stock': vLLM's own layers attend densely; "
                             "leave schedule unset, or use attention='sparrow'")
        return self

    @model_validator(mode="after")
    def _full_decode_graphs_capture(self) -> "VllmEngineConfig":
        if self.cuda_graphs != "full_decode":
            return self
        clashes = {
            "enforce_eager=true": (self.enforce_eager is True, "no graphs at all"),
            "attention='stock'": (self.attention == "stock", "vLLM's own layers choose their graphs"),
            "attention_backend='reference'": (self.attention_backend == "reference",
                                              "the torch kernels read lengths on the host, which a graph cannot"),
            f"block_size={self.block_size}": (self.block_size not in (None, BLOCK_SIZE),
                                              f"a decode graph reads vLLM's block table as Sparrow's: pages of "
                                              f"{BLOCK_SIZE} tokens"),
            f"trace_steps={self.trace_steps}": (self.trace_steps > 0, "the trace reads every step on the host"),
        }
        for setting, (clash, why) in clashes.items():
            if clash:
                raise ValueError(f"cuda_graphs='full_decode' with {setting}: {why}; use cuda_graphs='piecewise'")
        return self

    @model_validator(mode="after")
    def _sleep_mode_reloads_in_place(self) -> "VllmEngineConfig":
        if self.sleep_mode and self.weight_update == "recreate":
            raise ValueError("sleep_mode=true with weight_update='recreate': a restarted vLLM takes its GPU memory back "
                             "while the engine should sleep; use weight_update='memory', 'reload' or 'auto' with "
                             "sleep mode")
        return self

    @field_validator("landmark")
    @classmethod
    def _landmark(cls, value: str) -> str:
        if value == "mean_int8":
            raise ValueError("landmark=mean_int8: the vLLM backend keeps landmarks in the model's dtype; use mean here, "
                             "or the native engine")
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _kv_cache_dtype(cls, value: str) -> str:
        if value != "auto":
            raise ValueError(f"kv_cache_dtype={value!r}: the vLLM backend stores K/V in the model's dtype; use auto here, "
                             "or the native engine for FP8 pages")
        return value

    @field_validator("block_size")
    @classmethod
    def _block_size(cls, value: int | None) -> int | None:
        if value is not None and (value < BLOCK_SIZE or value % BLOCK_SIZE):
            raise ValueError(f"block_size={value}: must be a multiple of {BLOCK_SIZE} (Sparrow's block); "
                             f"use {BLOCK_SIZE} on CUDA, {2 * BLOCK_SIZE} on CPU")
        return value


def split_kv_budget(total_bytes: int, num_layers: int, num_sparse_layers: int, num_kv_heads: int, head_dim: int,
                    landmark_width: int) -> int:
    """Bytes to give vLLM's KV pages so that pages + landmark side tables fit in `total_bytes`.

    Per Sparrow block: K and V of every layer (2·BLOCK_SIZE·D per KV head) and one landmark of W values
    per sparse layer. vLLM rounds its page count down, so the side tables, sized from that count,
    never push the total over the budget.
    """
    kv = num_layers * 2 * BLOCK_SIZE * head_dim * num_kv_heads
    landmarks = num_sparse_layers * landmark_width * num_kv_heads
    return total_bytes * kv // (kv + landmarks)
