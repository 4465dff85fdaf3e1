"""DeepSpeed around a Hugging Face causal LM: process group, model loading, ZeRO config, AdamW and LR schedule.

CPU runs use gloo, float32 and a client-side `torch.optim.AdamW`, so no DeepSpeed op is compiled.
DeepSpeed still JIT-compiles its shared-memory all-reduce (`deepspeed_shm_comm`, ~50–90 s on two
cores) on the first CPU `init_distributed`; that kernel only serves DeepSpeed-inference's
`inference_all_reduce`, which ZeRO training never calls, so on gloo we mark it unavailable before
initialising (docs/trainer.md has the measurements).
"""

import math
import os
from collections.abc import Callable

import torch

from .config import OptimizerConfig, TrainerConfig


def resolve_device(config: TrainerConfig, rank: int) -> torch.device:
    """CPU, or this rank's GPU among the visible ones (Ray gives each actor one: index 0) — made current."""
    if config.device == "cuda" or (config.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ValueError("device='cuda' but CUDA is not available; use device='cpu' or 'auto'")
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def resolve_dtype(config: TrainerConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]


def set_rank_environment(rank: int, world_size: int, master_addr: str, master_port: int, local_rank: int, local_size: int) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        LOCAL_RANK=str(local_rank),
        LOCAL_SIZE=str(local_size),
    )


def init_distributed(backend: str) -> None:
    """torch.distributed through DeepSpeed (env:// rendezvous from `set_rank_environment`)."""
    import deepspeed
    import deepspeed.ops

    if backend == "gloo":
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend)


def deepspeed_config(config: TrainerConfig, dtype: torch.dtype) -> dict:
    """Micro-batches are formed by the trainer, which marks the accumulation boundary itself."""
    zero: dict = {"stage": config.zero_stage}
    if config.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = True
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "gradient_clipping": config.optimizer.grad_clip or 0.0,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def lr_lambda(opt: OptimizerConfig) -> Callable[[int], float]:
    """Factor on the peak LR after `step` optimizer steps: linear warmup, then constant/cosine/linear."""

    def factor(step: int) -> float:
        if step < opt.warmup_steps:
            return (step + 1) / opt.warmup_steps
        if opt.decay == "constant":
            return 1.0
        span = max(opt.total_steps - opt.warmup_steps, 1)
        progress = min(max(step - opt.warmup_steps, 0) / span, 1.0)
        if opt.decay == "cosine":
            return opt.min_lr_ratio + (1 - opt.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
        return 1.0 - (1 - opt.min_lr_ratio) * progress

    return factor


def make_optimizer(params, opt: OptimizerConfig, lr_scale: float = 1.0):
    optimizer = torch.optim.AdamW(
        params, lr=opt.lr * lr_scale, betas=opt.betas, eps=opt.eps, weight_decay=opt.weight_decay
    )
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(opt))


def initialize_adam_states(optimizer: torch.optim.Optimizer) -> int:
    """Adam's moments made now, as torch's first step would make them (zeros, `step` 0 where it keeps it), for the
    parameters that have none yet; returns how many got them. A colocated rank moves its states to pinned host
    memory before the engines start: moments made lazily by the first update had their pinned buffers allocated
    inside the first step's offload instead (7.7-22.4 s on an H200). Training is bitwise the same (tested)."""
    made = 0
    for group in optimizer.param_groups:
        on_device = group.get("capturable") or group.get("fused")
        moments = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
        for p in group["params"]:
            if optimizer.state[p]:
                continue
            step = torch.zeros((), dtype=torch.float32, device=p.device) if on_device else torch.tensor(0.0)
            optimizer.state[p] = {"step": step, **{m: torch.zeros_like(p) for m in moments}}
            made += 1
    return made


def load_causal_lm(path: str, dtype: torch.dtype, attn_implementation: str):
    """The policy from an HF directory, on the CPU: `deepspeed.initialize` moves it (ZeRO-3 partitions it
    while loading when an HfDeepSpeedConfig is alive)."""
    from transformers import AutoModelForCausalLM

    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model={path!r}: not a Hugging Face model directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    softcap = getattr(model.config, "final_logit_softcapping", None)
    if softcap:
        raise ValueError(
            f"model={path!r} uses final_logit_softcapping={softcap}, which the chunked log-softmax does not apply; "
            "use a model without logit soft-capping"
        )
    model.config.use_cache = False
    return model
