"""The GRPO/PPO update of the dense policy on a rank's shard: π_old, then mini-batches × epochs of micro-batch
passes up to DeepSpeed's accumulation boundary, and the step's metrics summed over ranks."""

import time
from dataclasses import dataclass

import torch

from sparrow.schedule import SparsitySchedule

from .alpha import AlphaReport, add_micro_batch_alpha, merged_over_ranks
from .batch import Trajectory, TrajectoryBatch
from .collectives import all_reduce_dict
from .config import TrainerConfig
from .lockstep import global_loss_tokens, lockstep_plans
from .losses import policy_loss
from .microbatch import collate
from .policy import Policy
from .recompute import recompute

LOSS_SUM_KEYS = (
    "tokens", "clipped", "dual_clipped", "tis_capped", "band_masked", "abs_log_ratio", "ppo_kl", "pg_loss",
    "entropy", "tokens_total",
)
"""Per-step sums every rank reports: the same keys everywhere, so the all-reduce lines up even on a
rank whose shard was empty."""


@dataclass
class PolicyUpdate:
    metrics: dict[str, float]
    alpha: AlphaReport
    """α of the rollouts against π_old, all ranks merged."""
    old_logprobs: list[torch.Tensor | None]
    """π_old's dense log-probs per trajectory (DistillSparse's KL target)."""
    gradients: dict[str, torch.Tensor] | None


def mini_batch_indices(n: int, parts: int) -> list[list[int]]:
    """Consecutive near-equal index ranges (PPO mini-batches; some may be empty on a small shard)."""
    bounds = [round(k * n / parts) for k in range(parts + 1)]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def update_policy(policy: Policy, config: TrainerConfig, bins: SparsitySchedule, batch: TrajectoryBatch, *,
                  world_size: int, step: int, start: float, return_gradients: bool) -> PolicyUpdate:
    """On-policy (1 mini-batch, 1 epoch) π_old is the same forward, detached; otherwise a dense recompute gives
    π_old first. Collective. `step` is the step this update makes, `start` when it began (for its throughput)."""
    cfg = config.loss
    trajectories = list(batch)
    if cfg.on_policy:
        old, report = [None] * len(trajectories), AlphaReport(bins.num_bins)
    else:
        pre = recompute(policy, config, bins, batch)
        old, report = pre.logprobs, pre.alpha
    sums = dict.fromkeys(LOSS_SUM_KEYS + (("ref_kl",) if policy.ref_forward else ()), 0.0)
    maxes = {"abs_log_ratio": 0.0}
    gradients, norm = None, None
    engine = policy.engine
    skipped_before = engine.skipped_steps  # DeepSpeed drops an update whose gradients are not finite
    parts = mini_batch_indices(len(trajectories), cfg.mini_batches)
    for epoch in range(cfg.epochs):
        for k, part in enumerate(parts):
            members = [trajectories[i] for i in part]
            dense = _accumulate(policy, config, bins, world_size, members, [old[i] for i in part], sums, maxes,
                                report if cfg.on_policy else None)
            if cfg.on_policy:
                old = dense
            if return_gradients and epoch == cfg.epochs - 1 and k == len(parts) - 1:
                gradients = _full_gradients(policy)
            engine.step()
            norm = engine.get_global_grad_norm()
    metrics = _step_metrics(policy, sums, maxes, norm, start, step)
    metrics["train/skipped_updates"] = float(engine.skipped_steps - skipped_before)
    alpha = merged_over_ranks(report) if cfg.on_policy else report
    return PolicyUpdate(metrics, alpha, old, gradients)


def _accumulate(policy: Policy, config: TrainerConfig, bins: SparsitySchedule, world_size: int, members: list[Trajectory],
                old: list, sums: dict, maxes: dict, report: AlphaReport | None) -> list:
    """Forward/backward over one mini-batch's micro-batches, up to the accumulation boundary.

    `old[i]` None means on-policy (π_old = this forward, detached). Adds this rank's loss sums
    and maxima into `sums`/`maxes` and returns the π_old log-probs per trajectory.
    """
    engine, forward, ref_forward, device = policy.engine, policy.forward, policy.ref_forward, policy.device
    engine.module.train()
    normalizer = global_loss_tokens(members, device)
    plans, passes = lockstep_plans(members, config.micro_batch_tokens, device)
    dense_old: list[torch.Tensor | None] = [None] * len(members)
    for j in range(passes):
        engine.set_gradient_accumulation_boundary(j == passes - 1)
        if j >= len(plans) or normalizer == 0:
            if ref_forward is not None:
                with torch.no_grad():
                    ref_forward.dummy_loss()
            with forward.adapter(False):
                engine.backward(forward.dummy_loss())
            continue
        mb = collate(members, plans[j], pad_id=0)
        ref = None
        if ref_forward is not None:
            with torch.no_grad():
                ref = ref_forward.stats(mb).logprobs
        with forward.adapter(False):
            stats = forward.stats(mb)
            logp = stats.logprobs
            old_lp = logp.detach() if old[mb.indices[0]] is None else torch.cat([old[i] for i in mb.indices]).to(device)
            mask = mb.per_token(members, "mask", device)
            out = policy_loss(
                logp, old_lp, mb.per_token(members, "rollout_logprobs", device),
                mb.per_token(members, "advantage", device), mask, config.loss, normalizer, ref,
            )
            # DeepSpeed averages gradients over ranks; the loss is already a share of the global token mean.
            engine.backward(out.loss * world_size)
        for key, v in out.sums.items():
            sums[key] += float(v)
        for key, v in out.maxes.items():
            maxes[key] = max(maxes[key], float(v))
        sums["entropy"] += float((stats.entropy * mask).sum())
        sums["tokens_total"] += float(sum(members[i].total_len for i in mb.indices))
        for i, lp in zip(mb.indices, mb.per_row(old_lp.cpu())):
            dense_old[i] = lp
        if report is not None:
            add_micro_batch_alpha(report, mb, members, stats.top_ids, stats.top_logprobs, bins)
    return dense_old


def _full_gradients(policy: Policy) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_grad

    grads = {}
    for name, p in policy.exporter.params.items():
        g = safe_get_full_grad(p)
        if g is not None:
            grads[name] = g.detach().float().cpu().clone()
    return grads


def _step_metrics(policy: Policy, sums: dict, maxes: dict, grad_norm, start: float, step: int) -> dict[str, float]:
    total = all_reduce_dict(sums, "sum", policy.device)
    peak = all_reduce_dict(maxes, "max", policy.device)
    n = max(total["tokens"], 1.0)
    seconds = time.perf_counter() - start
    metrics = {
        "train/loss_tokens": total["tokens"],
        "train/tokens": total["tokens_total"],
        "train/seconds": seconds,
        "train/tokens_per_s": total["tokens_total"] / seconds,
        "train/pg_loss": total["pg_loss"] / n,
        "train/clip_fraction": total["clipped"] / n,
        "train/dual_clip_fraction": total["dual_clipped"] / n,
        "train/tis_capped_fraction": total["tis_capped"] / n,
        "train/band_masked_fraction": total["band_masked"] / n,
        "train/abs_log_ratio_mean": total["abs_log_ratio"] / n,
        "train/abs_log_ratio_max": peak["abs_log_ratio"],
        "train/ppo_kl": total["ppo_kl"] / n,
        "train/entropy": total["entropy"] / n,
        "train/grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
        "train/lr": float(policy.scheduler.get_last_lr()[0]),
        "train/step": float(step),
    }
    if "ref_kl" in total:
        metrics["train/ref_kl"] = total["ref_kl"] / n
    return metrics
