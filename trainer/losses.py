"""The policy loss, token by token (pure functions; docs/trainer.md has the formulas).

Per response token with advantage A, current log-prob logπ, π_old log-prob logπ_old (the dense
recompute) and rollout log-prob logq (the sparse engine's):

    r    = exp(clamp(logπ − logπ_old, ±20))
    L    = max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high))        PPO clip, asymmetric ε
    L    = min(L, −A·c)  where A < 0                              dual clip
    w    = exp(clamp(logπ_old − logq, ±20))                        dense / rollout ratio (no gradient)
    L    = L · min(w, C)                                           TIS (when on)
    L    = L · [low ≤ w ≤ high]                                    MIS / IcePop band (when on)
    loss = Σ_tokens L / N  (+ β · Σ_tokens k3(logπ, logπ_ref) / N)  token mean over the whole batch

N counts every loss token of the optimizer step on all ranks, masked-out band tokens included, so a
token's gradient does not depend on how the batch was split or how many neighbours were masked.
"""

from dataclasses import dataclass

import torch

from .config import LossConfig

LOG_RATIO_CLAMP = 20.0


def k3_kl(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(π ‖ π_ref) at tokens sampled from π: e^δ − δ − 1, δ = logπ_ref − logπ.

    δ is clamped to ±20 and the result to [−10, 10], as verl's "low_var_kl".
    """
    delta = (ref_logp - logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (delta.exp() - delta - 1.0).clamp(-10.0, 10.0)


def ppo_clip_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate; also returns where the ε clip and the dual clip were active."""
    ratio = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    dual_active = torch.zeros_like(clip_active)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (loss > bound)
        loss = torch.where(dual_active, bound, loss)
    return loss, clip_active, dual_active


def rollout_correction(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    tis_cap: float | None,
    mask_band: tuple[float, float] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weight per token for the dense/rollout mismatch: TIS min(w, C) times the band mask.

    Returns (weight, raw ratio w, kept-by-band mask); nothing here carries gradient.
    """
    ratio = (old_logp - rollout_logp).detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    weight = ratio.clamp(max=tis_cap) if tis_cap is not None else torch.ones_like(ratio)
    keep = torch.ones_like(ratio, dtype=torch.bool)
    if mask_band is not None:
        keep = (ratio >= mask_band[0]) & (ratio <= mask_band[1])
    return weight * keep, ratio, keep


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Scalar: this slice's share of the batch's token-mean loss (sum over its tokens / N)."""
    sums: dict[str, torch.Tensor]
    """Counts and sums over this slice's loss tokens; add across slices and ranks."""
    maxes: dict[str, torch.Tensor]
    """Maxima over this slice's loss tokens; max across slices and ranks."""


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: LossConfig,
    normalizer: float,
    ref_logp: torch.Tensor | None = None,
) -> LossOutput:
    """Loss of a slice of tokens (all `[N]`); `normalizer` = loss tokens in the whole optimizer step."""
    if normalizer <= 0:
        raise ValueError(f"normalizer={normalizer}: the number of loss tokens must be positive")
    if config.kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef={config.kl_coef} needs ref_logp (a reference model's log-probs)")
    mask = mask.bool()
    m = mask.to(logp.dtype)
    pg, clip_active, dual_active = ppo_clip_loss(
        logp, old_logp.detach(), advantages, config.clip_eps_low, config.clip_eps_high, config.dual_clip
    )
    weight, ratio, keep = rollout_correction(old_logp, rollout_logp, config.tis_cap, config.mask_band)
    loss = (pg * weight * m).sum() / normalizer
    kl = None
    if config.kl_coef > 0:
        kl = k3_kl(logp, ref_logp.detach())
        loss = loss + config.kl_coef * (kl * m).sum() / normalizer
    abs_log_ratio = (old_logp - rollout_logp).detach().abs()
    count = lambda x: (x & mask).sum().to(torch.float64)  # noqa: E731
    sums = {
        "tokens": mask.sum().to(torch.float64),
        "clipped": count(clip_active),
        "dual_clipped": count(dual_active),
        "tis_capped": count(ratio > config.tis_cap) if config.tis_cap is not None else torch.zeros((), dtype=torch.float64),
        "band_masked": count(~keep),
        "abs_log_ratio": (abs_log_ratio * m).sum().double(),
        "ppo_kl": ((old_logp.detach() - logp.detach()) * m).sum().double(),
        "pg_loss": (pg.detach() * weight * m).sum().double(),
    }
    if kl is not None:
        sums["ref_kl"] = (kl.detach() * m).sum().double()
    zero = torch.zeros((), dtype=torch.float64)
    maxes = {"abs_log_ratio": abs_log_ratio[mask].max().double() if bool(mask.any()) else zero}
    return LossOutput(loss=loss, sums=sums, maxes=maxes)
