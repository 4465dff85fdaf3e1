"""GRPO advantages: each sample's reward against its group (the N samples of one prompt)."""

from collections.abc import Sequence

import torch


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: Sequence,
    std_norm: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """A_i = (r_i − mean_g) / (std_g + eps), or r_i − mean_g without `std_norm`.

    std_g is the unbiased sample standard deviation of the group (as verl). A group of one sample
    has no baseline, so its advantage is 0 rather than its raw reward.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if len(group_ids) != rewards.numel():
        raise ValueError(f"{rewards.numel()} rewards but {len(group_ids)} group ids")
    if not torch.isfinite(rewards).all():
        bad = torch.nonzero(~torch.isfinite(rewards)).flatten().tolist()
        raise ValueError(f"rewards at positions {bad[:8]} are not finite")
    index: dict = {}
    gid = torch.tensor([index.setdefault(g, len(index)) for g in group_ids], dtype=torch.long)
    num_groups = len(index)
    count = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, gid, torch.ones_like(rewards))
    mean = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, gid, rewards) / count
    centred = rewards - mean[gid]
    adv = centred
    if std_norm:
        var = torch.zeros(num_groups, dtype=torch.float64).index_add_(0, gid, centred**2) / (count - 1).clamp(min=1)
        adv = centred / (var.sqrt()[gid] + eps)
    return torch.where(count[gid] > 1, adv, torch.zeros_like(adv))
