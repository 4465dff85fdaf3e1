"""`NativeEngineConfig`: the native engine's section of the Sparrow config."""

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from sparrow.schedule import SparsitySchedule

from ..api import SamplingParams
from ..engine_settings import EngineSettings

DType = Literal["auto", "float32", "bfloat16", "float16"]


class NativeEngineConfig(EngineSettings):
    """Everything the native rollout engine needs besides the requests.

    The KV pool is `num_kv_blocks` blocks of `sparrow.layout.BLOCK_SIZE` tokens in every layer. Left unset, it is
    sized from `kv_memory_fraction` of the memory free after the weights are loaded, capped at what
    `max_num_seqs` sequences of `max_model_len` tokens could ever use.
    """

    releases_memory: ClassVar[bool] = True
    interrupts: ClassVar[bool] = True

    model: str | None = Field(None, description="HF model directory (config.json + safetensors)")
    dtype: DType = Field("auto", description="weights, activations and KV cache; auto = float32 on CPU, bfloat16 on CUDA")
    device: str = Field("cpu", description="cpu, cuda or cuda:N")
    attention_backend: Literal["auto", "torch", "reference", "triton"] = Field(
        "auto",
        description="decode attention; auto = triton on CUDA when importable, else torch (the reference "
        "semantics with fast gathers); reference = sparrow.kernels.ReferenceBackend",
    )
    cuda_graphs: bool | None = Field(
        None,
        description="replay the decode step from CUDA graphs (one per batch-size and block-table-width bucket); "
        "None = on for CUDA with the triton backend (with tensor parallelism too: its all-reduces are captured), "
        "False = eager launches",
    )
    num_kv_blocks: int | None = Field(None, ge=1, description="KV pool size in blocks; None = from kv_memory_fraction")
    kv_memory_fraction: float = Field(0.3, gt=0, le=0.95, description="share of free memory for the KV pool")
    max_model_len: int | None = Field(None, ge=2, description="prompt + generated tokens; None = model maximum")
    prefill_chunk_size: int = Field(2048, ge=16, description="most prompt tokens computed in one prefill step")
    default_logprobs: int = Field(20, ge=0, description="top-k logprobs per token when a caller does not say")
    seed: int = Field(0, description="draws the seeds of requests that give none")
    overlap_decode: bool = Field(
        False,
        description="launch each decode step before reading the previous step's tokens (fed to it on the device), "
        "so the host's bookkeeping runs while the GPU computes; a sample that stops at a stop token costs one "
        "discarded row. Same samples as without; 1.05-1.10x the plain loop's rollout tokens/s on an H200 (bench "
        "rollout, on the wall clock), off by default until it has run inside a training job on a GPU",
    )
    fused_sampling: bool = Field(
        True,
        description="on CUDA, sample batches without top-p / top-k filtering by one pass of a Triton kernel over the "
        "logits (same distribution and logprobs, other draws than the eager sampler's for a seed); False = the "
        "PyTorch sampler everywhere (about a dozen passes over the logits and one noise launch per row)",
    )
    tensor_parallel_size: int = Field(
        1, ge=1,
        description="ranks the decoder is split over (attention heads and MLP, Megatron-style), each a process with "
        "its own engine and device in a torch.distributed group of this size; must divide the model's attention "
        "heads, KV heads and intermediate size; jobs (Ray rollout workers) take only 1 so far "
        "(docs/native_engine.md, Tensor parallelism)",
    )
    symmetric_memory_all_reduce: bool = Field(
        True,
        description="with tensor parallelism on CUDA, sum the decode steps' row-parallel outputs through PyTorch's "
        "symmetric memory (one-shot over NVLink; prefill chunks stay on NCCL) where every rank's torch supports it; "
        "False = NCCL for every all-reduce",
    )

    def check_job(self, sampling: SamplingParams, schedule: SparsitySchedule, section: str, name: str) -> None:
        """The shared rules, and: no tensor parallelism in a job, whose rollout workers run one engine process each."""
        super().check_job(sampling, schedule, section, name)
        if self.tensor_parallel_size > 1:
            raise ValueError(
                f"{section}.{name}.tensor_parallel_size={self.tensor_parallel_size}: the rollout workers do not run "
                "tensor-parallel engines yet (one process a rank is not wired into them); use 1"
            )

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if value != "cpu" and not (value == "cuda" or (value.startswith("cuda:") and value[5:].isdigit())):
            raise ValueError(f"device={value!r}: use cpu, cuda or cuda:N")
        return value
