"""A rank's model side, built once by `build_policy`: the DeepSpeed engine around the policy with its LR schedule,
the DistillSparse adapter and its own optimizer, the frozen reference model, and the weight exporter. The step
modules (recompute, update, distill, exact α), publication, checkpoints and export all work on this one object."""

from dataclasses import dataclass
from typing import Any

import torch

from . import sparse_attention
from .config import TrainerConfig
from .engine import (
    deepspeed_config,
    init_distributed,
    load_causal_lm,
    make_optimizer,
    resolve_device,
    resolve_dtype,
    set_rank_environment,
)
from .export import WeightExporter
from .forward import PolicyModule, PolicyRunner
from .lora import attach_lora, is_lora_param


@dataclass
class LoraTraining:
    """DistillSparse's adapter: trained outside DeepSpeed by its own optimizer, replicated on every rank."""

    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    forward: PolicyRunner
    """Calls the module directly, so the adapter's forward registers none of the engine's ZeRO backward hooks."""


@dataclass
class Policy:
    device: torch.device
    dtype: torch.dtype
    engine: Any
    """The `deepspeed.DeepSpeedEngine` around the `PolicyModule`; it owns the dense optimizer."""
    scheduler: torch.optim.lr_scheduler.LRScheduler
    forward: PolicyRunner
    exporter: WeightExporter
    """The policy's own parameters by HF name (the adapter's left out): what is published, exported, checked."""
    vocab_size: int
    lora: LoraTraining | None = None
    ref_forward: PolicyRunner | None = None
    zero3_config: Any = None
    """transformers' `HfDeepSpeedConfig` under ZeRO-3: it must stay alive, `from_pretrained` partitions under it."""

    @property
    def base_params(self) -> list[torch.nn.Parameter]:
        return list(self.exporter.params.values())


def join_process_group(config: TrainerConfig, rank: int, world_size: int, master_addr: str,
                       master_port: int) -> torch.device:
    """This rank's device, made current, once the rank has joined the trainers' torch.distributed group."""
    device = resolve_device(config, rank)
    if device.type == "cuda":
        local_rank, local_size = device.index, torch.cuda.device_count()
    else:
        local_rank, local_size = rank, world_size
    set_rank_environment(rank, world_size, master_addr, master_port, local_rank, local_size)
    init_distributed("nccl" if device.type == "cuda" else "gloo")
    return device


def build_policy(config: TrainerConfig, device: torch.device) -> Policy:
    """The policy (and the reference model when `loss.kl_coef` > 0) under DeepSpeed; the base trains, the
    adapter is frozen outside `distill_step`."""
    import deepspeed

    cfg = config
    dtype = resolve_dtype(cfg, device)
    torch.manual_seed(cfg.seed)
    ds_config = deepspeed_config(cfg, dtype)
    zero3_config = None
    if cfg.zero_stage == 3:
        from transformers.integrations import HfDeepSpeedConfig

        zero3_config = HfDeepSpeedConfig(ds_config)
    distill = cfg.distill_sparse.enabled
    model = load_causal_lm(cfg.model, dtype, sparse_attention.register() if distill or cfg.exact_alpha else "sdpa")
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if distill:
        cfg.distill_sparse.layout_for(None).check_layers(model.config.num_hidden_layers, "distill_sparse.dense_layers")
        model = attach_lora(model, cfg.distill_sparse)
    module = PolicyModule(model, cfg.temperature, cfg.recompute_topk, cfg.logprob_chunk_tokens)
    named = list(module.named_parameters())
    base = [p for n, p in named if not is_lora_param(n)]
    lora_params = [p for n, p in named if is_lora_param(n)]
    for p in base:  # peft freezes the base model; the dense update trains it
        p.requires_grad_(True)
    for p in lora_params:  # trained only inside distill_step
        p.requires_grad_(False)
    optimizer, scheduler = make_optimizer(base, cfg.optimizer)
    engine, _, _, scheduler = deepspeed.initialize(
        model=module, optimizer=optimizer, lr_scheduler=scheduler, config=ds_config
    )
    return Policy(
        device=device, dtype=dtype, engine=engine, scheduler=scheduler, forward=PolicyRunner(engine, engine.module, device),
        exporter=WeightExporter(engine.module, cfg.zero_stage == 3), vocab_size=model.config.vocab_size,
        lora=_lora_training(cfg, engine, lora_params, device) if distill else None,
        ref_forward=_reference(cfg, dtype, ds_config, device) if cfg.loss.kl_coef > 0 else None,
        zero3_config=zero3_config,
    )


def _lora_training(cfg: TrainerConfig, engine, params: list[torch.nn.Parameter], device: torch.device) -> LoraTraining:
    for p in params:  # DeepSpeed cast the module to bf16 on GPU; the adapter keeps fp32 weights
        p.data = p.data.float()  # (peft casts activations to the adapter's dtype and back)
    optimizer, scheduler = make_optimizer(params, cfg.optimizer, cfg.distill_sparse.lr_scale)
    return LoraTraining(params, optimizer, scheduler, PolicyRunner(engine.module, engine.module, device))


def _reference(cfg: TrainerConfig, dtype: torch.dtype, ds_config: dict, device: torch.device) -> PolicyRunner:
    """The frozen starting policy, for the reference KL term."""
    import deepspeed

    ref = load_causal_lm(cfg.model, dtype, "sdpa")
    ref.requires_grad_(False)
    ref_config = {k: v for k, v in ds_config.items() if k != "gradient_clipping"}
    module = PolicyModule(ref, cfg.temperature, 1, cfg.logprob_chunk_tokens)
    engine = deepspeed.initialize(model=module, config=ref_config)[0]
    engine.eval()
    return PolicyRunner(engine, engine.module, device)
