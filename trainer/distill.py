"""DistillSparse: one update of the LoRA adapter through the sparse-attention forward, base frozen, so the
trainer's sparse forward (the rollout policy q) moves towards the dense policy (docs/trainer.md, "DistillSparse")."""

import time

import torch

from sparrow.schedule import SparsitySchedule

from .batch import TrajectoryBatch
from .collectives import all_reduce_dict, all_reduce_grads
from .config import TrainerConfig
from .lockstep import global_loss_tokens
from .losses import k3_kl, ppo_clip_loss, rollout_correction
from .microbatch import collate, plan_micro_batches
from .policy import Policy
from .sparse_attention import micro_batch_forward


def distill_step(policy: Policy, config: TrainerConfig, schedule: SparsitySchedule | None, batch: TrajectoryBatch,
                 dense_logprobs: list[torch.Tensor]) -> dict[str, float]:
    """loss = [PPO on the sparse log-probs, on-policy] + λ·k3(sparse+LoRA ‖ dense) at the sampled tokens, token
    mean over all ranks, under `schedule`; `dense_logprobs` (per trajectory) is the KL target. Collective."""
    cfg = config.distill_sparse
    if not cfg.enabled:
        raise RuntimeError("distill_step needs distill_sparse.enabled=true in the TrainerConfig")
    if schedule is None:
        raise ValueError("distill_step needs a sparsity schedule (TrainerConfig.schedule or set_schedule); none is set")
    start = time.perf_counter()
    trajectories = list(batch)
    if len(dense_logprobs) != len(trajectories):
        raise ValueError(f"{len(dense_logprobs)} dense log-prob tensors for {len(trajectories)} trajectories")
    lora, device, base = policy.lora, policy.device, policy.base_params
    for p in base:
        p.requires_grad_(False)
    for p in lora.params:
        p.requires_grad_(True)
    policy.engine.module.train()
    layout = cfg.layout_for(schedule)
    sums = {"tokens": 0.0, "kl": 0.0, "pg": 0.0, "abs_log_ratio": 0.0}
    try:
        normalizer = global_loss_tokens(trajectories, device)
        for plan in plan_micro_batches([t.total_len for t in trajectories], config.micro_batch_tokens):
            mb = collate(trajectories, plan, pad_id=0)
            with lora.forward.adapter(True):
                sparse = micro_batch_forward(mb, layout, schedule, device, config.kv_cache_dtype)
                logq = lora.forward.stats(mb, sparse).logprobs
            mask = mb.per_token(trajectories, "mask", device).float()
            dense = torch.cat([dense_logprobs[i] for i in mb.indices]).to(device)
            kl = k3_kl(logq, dense)
            loss = cfg.kl_coef * (kl * mask).sum()
            if cfg.policy_loss:
                adv = mb.per_token(trajectories, "advantage", device)
                lc = config.loss
                pg, _, _ = ppo_clip_loss(logq, logq.detach(), adv, lc.clip_eps_low, lc.clip_eps_high, lc.dual_clip)
                rollout = mb.per_token(trajectories, "rollout_logprobs", device)
                weight, _, _ = rollout_correction(logq, rollout, cfg.tis_cap, None)
                pg = pg * weight * mask
                loss = loss + pg.sum()
                sums["pg"] += float(pg.detach().sum())
            (loss / normalizer).backward()
            sums["tokens"] += float(mask.sum())
            sums["kl"] += float((kl.detach() * mask).sum())
            sums["abs_log_ratio"] += float(((logq.detach() - dense).abs() * mask).sum())
        all_reduce_grads(lora.params)
        clip = config.optimizer.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(lora.params, clip if clip is not None else float("inf"))
        lora.optimizer.step()
        lora.scheduler.step()
    finally:
        lora.optimizer.zero_grad(set_to_none=True)
        for p in lora.params:
            p.requires_grad_(False)
        for p in base:
            p.requires_grad_(True)
    total = all_reduce_dict(sums, "sum", device)
    n = max(total["tokens"], 1.0)
    return {
        "distill/kl": total["kl"] / n,
        "distill/pg_loss": total["pg"] / n,
        "distill/abs_log_ratio_mean": total["abs_log_ratio"] / n,
        "distill/grad_norm": float(norm),
        "distill/lr": float(lora.scheduler.get_last_lr()[0]),
        "distill/seconds": time.perf_counter() - start,
    }
