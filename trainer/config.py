"""`TrainerConfig`: the trainer's section of the Sparrow config (DeepSpeed engine, loss, DistillSparse)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sparrow.layout import KVCacheDType
from sparrow.layout_settings import SparseLayerSettings


class OptimizerConfig(BaseModel):
    """Client-side torch AdamW (no DeepSpeed op compilation) with warmup and an optional decay."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-6, gt=0, description="peak learning rate (Sparrow: 1e-6 math, 5e-7 code)")
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float | None = Field(1.0, gt=0, description="global gradient-norm clip; None = off")
    warmup_steps: int = Field(0, ge=0, description="linear warmup from 0 over this many optimizer steps")
    decay: Literal["constant", "cosine", "linear"] = "constant"
    total_steps: int | None = Field(None, ge=1, description="optimizer steps the decay spans (cosine/linear)")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="floor of the decay as a fraction of lr")

    @field_validator("betas")
    @classmethod
    def _betas(cls, value):
        if not all(0 <= b < 1 for b in value):
            raise ValueError(f"betas={list(value)}: each must be in [0, 1)")
        return value

    @model_validator(mode="after")
    def _decay_needs_horizon(self):
        if self.decay != "constant" and self.total_steps is None:
            raise ValueError(f"decay={self.decay!r} needs total_steps (the optimizer steps it spans); or use decay='constant'")
        return self


class LossConfig(BaseModel):
    """GRPO / PPO loss with truncated importance sampling against the (sparse) rollout policy."""

    model_config = ConfigDict(extra="forbid")

    clip_eps_low: float = Field(0.2, ge=0, lt=1, description="PPO ratio clip below: 1 - eps_low")
    clip_eps_high: float = Field(0.28, ge=0, description="PPO ratio clip above: 1 + eps_high (asymmetric, DAPO-style)")
    dual_clip: float | None = Field(3.0, gt=1, description="dual-clip bound c for negative advantages; None = off")
    tis_cap: float | None = Field(3.0, gt=0, description="TIS weight min(p_dense/q_rollout, C); None = TIS off")
    mask_band: tuple[float, float] | None = Field(
        None, description="[low, high]: tokens whose p_dense/q_rollout is outside are dropped (MIS / IcePop); None = off"
    )
    kl_coef: float = Field(0.0, ge=0, description="reference-KL (k3) coefficient; > 0 keeps a frozen reference model")
    advantage_std_norm: bool = Field(True, description="GRPO: divide by the group's reward std (False: mean-centre only)")
    advantage_eps: float = Field(1e-6, gt=0)
    mini_batches: int = Field(1, ge=1, description="optimizer steps per train_step (the batch is split this many ways)")
    epochs: int = Field(1, ge=1, description="passes over the batch per train_step")

    @field_validator("mask_band")
    @classmethod
    def _band(cls, value):
        if value is not None and not 0 <= value[0] < value[1]:
            raise ValueError(f"mask_band={list(value)}: need 0 <= low < high, e.g. [0.5, 2.0]")
        return value

    @property
    def on_policy(self) -> bool:
        """One optimizer step on the batch: π_old is the current forward, detached (Sparrow's setting)."""
        return self.mini_batches == 1 and self.epochs == 1


class DistillSparseConfig(SparseLayerSettings):
    """A LoRA adapter trained only through the trainer's sparse-attention forward (Sparrow §6); its
    `dense_layers` and `landmark` are those of that forward (block size, sink and recent: the schedule's)."""

    enabled: bool = False
    rank: int = Field(8, ge=1, description="LoRA rank r")
    alpha: float = Field(16.0, gt=0, description="LoRA alpha; the update is (alpha / r)·B·A")
    target_modules: list[str] | Literal["all-linear"] = Field("all-linear", description="peft target_modules")
    lr_scale: float = Field(5.0, gt=0, description="LoRA learning rate = optimizer.lr × lr_scale")
    kl_coef: float = Field(1e-3, ge=0, description="λ of the k3 KL(sparse+LoRA ‖ dense) at the sampled tokens")
    policy_loss: bool = Field(True, description="include the PPO term on the sparse logprobs")
    tis_cap: float | None = Field(None, gt=0, description="TIS cap of the sparse PPO term against the rollout; None = off")


class PublishConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    bucket_mb: float = Field(256.0, gt=0, description="weights are moved in buckets of about this many MiB")
    timeout_s: float = Field(600.0, gt=0, description="collective channel timeout")


class TrainerSettings(BaseModel):
    """What a job's `trainer` section sets: one dense-policy trainer (all its DeepSpeed ranks share it)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(..., description="HF model directory (config.json + safetensors)")
    zero_stage: Literal[1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available")
    dtype: Literal["auto", "float32", "bfloat16"] = Field("auto", description="auto = bfloat16 on cuda, float32 on cpu")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    micro_batch_tokens: int = Field(16384, ge=1, description="padded tokens per micro-batch (longer sequences run alone)")
    logprob_chunk_tokens: int = Field(2048, ge=1, description="positions per chunk of the fp32 vocabulary log-softmax")
    gradient_checkpointing: bool = True
    temperature: float = Field(1.0, gt=0, description="rollout temperature; logprobs are of logits / temperature")
    recompute_topk: int = Field(20, ge=1, description="top-k of the dense recompute (α against the rollout's top-k)")
    exact_alpha: bool = Field(
        False,
        description="also measure exact α every step: each trajectory teacher-forced through the dense and the sparse "
        "(+ DistillSparse adapter) forward under the schedule it was decoded with, full vocabulary on both sides; the "
        "step record's alpha_exact sits beside the top-k bounds (a diagnostic of the controller's statistic; costs about "
        "two forward passes over the step's tokens)",
    )
    schedule: str | None = Field(
        None, description="initial sparsity schedule (name or file): length bins of α and DistillSparse budgets"
    )
    seed: int = 0
    distill_sparse: DistillSparseConfig = Field(default_factory=DistillSparseConfig)
    publish: PublishConfig = Field(default_factory=PublishConfig)

    @model_validator(mode="after")
    def _distill_needs_replicated_lora(self):
        if self.distill_sparse.enabled and self.zero_stage == 3:
            raise ValueError(
                "distill_sparse.enabled=true with zero_stage=3: the LoRA adapter has its own optimizer and must "
                "stay replicated, which ZeRO-3 does not allow; use zero_stage 1 or 2"
            )
        return self


class TrainerConfig(TrainerSettings):
    """`TrainerSettings` plus what the trainer mirrors of the rollout engines, which a job takes from the engine's
    own section (standalone users of `TrainerRank` set it here)."""

    kv_cache_dtype: KVCacheDType = Field(
        "auto",
        description="the rollout engines' K/V pages: with fp8_e4m3 the sparse forward (exact α, DistillSparse) reads "
        "K/V rounded as the engines store them (the dense policy never does); a job sets it from "
        "rollout.<engine>.kv_cache_dtype",
    )
