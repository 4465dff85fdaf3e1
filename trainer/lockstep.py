"""What the ranks agree on before a pass over their shards: ZeRO-2/3 reduce gradients and ZeRO-3 gathers
parameters inside forward/backward, so every rank must run the same number of micro-batch passes, and each
loss is a share of the token mean over all ranks."""

import torch

from .batch import Trajectory
from .collectives import all_reduce_scalar
from .microbatch import plan_micro_batches


def lockstep_plans(trajectories: list[Trajectory], token_budget: int, device: torch.device) -> tuple[list[list[int]], int]:
    """This rank's micro-batches and the most any rank has (all must run that many passes)."""
    plans = plan_micro_batches([t.total_len for t in trajectories], token_budget)
    return plans, int(all_reduce_scalar(len(plans), "max", device))


def global_loss_tokens(trajectories: list[Trajectory], device: torch.device) -> float:
    """Loss tokens on all ranks: the normaliser of a token-mean loss."""
    return all_reduce_scalar(sum(int(t.response_mask().sum()) for t in trajectories), "sum", device)
