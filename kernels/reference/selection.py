"""Which blocks each (sequence, KV head) row attends to.

A row with n blocks and a budget of `budget` blocks (sinks and recents included) attends densely to
all n blocks when n ≤ budget. Otherwise it keeps blocks [0, sink), the exact top-(budget − sink −
recent) of the candidates [sink, n − recent) by score, and blocks [n − recent, n). Ties go to the
lower block index; NaN scores rank last. Lists are returned in ascending block order, which puts the
partial current block last.
"""

import torch


def select_blocks(
    scores: torch.Tensor,
    num_blocks: torch.Tensor,
    budgets: torch.Tensor,
    sink: int,
    recent: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`scores: [B, H_kv, M]`, `num_blocks: [B]`, `budgets: [B]` (total blocks per row).

    Returns `(block_ids, counts)`: `block_ids: [B, H_kv, K]` logical block ids in ascending order,
    padded with -1, and `counts: [B]` blocks attended per row (equal across a sequence's KV heads).
    """
    keep, counts = selected_blocks_mask(scores, num_blocks, budgets, sink, recent)
    bsz, heads, max_blocks = scores.shape
    pos = torch.arange(max_blocks, device=scores.device)
    width = int(counts.max()) if bsz else 0
    slot = torch.cumsum(keep.long(), dim=-1) - 1
    block_ids = torch.full((bsz, heads, width + 1), -1, dtype=torch.long, device=scores.device)
    target = torch.where(keep, slot, width)
    block_ids.scatter_(-1, target, pos.expand(bsz, heads, max_blocks).clone())
    block_ids = block_ids[..., :width]
    return block_ids, counts


def selected_blocks_mask(
    scores: torch.Tensor,
    num_blocks: torch.Tensor,
    budgets: torch.Tensor,
    sink: int,
    recent: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_blocks`'s choice as a boolean `[B, H_kv, M]` (True = attended) and `counts: [B]`, without the
    compaction into lists (which reads the widest count back to the host)."""
    if recent < 1:
        raise ValueError(f"recent={recent}: must be >= 1 (the partial block has no landmark)")
    bsz, heads, max_blocks = scores.shape
    device = scores.device
    num_blocks = num_blocks.long().to(device)
    budgets = torch.maximum(budgets.long().to(device), torch.full_like(num_blocks, sink + recent))
    counts = torch.minimum(num_blocks, budgets)
    dense = num_blocks <= budgets
    k_row = torch.where(dense, 0, budgets - sink - recent)

    pos = torch.arange(max_blocks, device=device)
    candidate = (pos[None, :] >= sink) & (pos[None, :] < (num_blocks - recent)[:, None])
    rank = candidate_rank(scores, candidate[:, None, :].expand_as(scores))
    chosen = candidate[:, None, :] & (rank < k_row[:, None, None])

    reserved = (pos[None, :] < sink) | (pos[None, :] >= (num_blocks - recent)[:, None])
    keep = (reserved & (pos[None, :] < num_blocks[:, None]))[:, None, :] | chosen
    keep = keep | (dense[:, None, None] & (pos[None, None, :] < num_blocks[:, None, None]))
    return keep, counts


def candidate_rank(scores: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Rank of every position along the last dim: candidates first, by descending score (NaN last),
    ties to the lower index; non-candidates after all candidates."""
    ranked = torch.nan_to_num(scores.double(), nan=float("-inf"), posinf=float("inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    order = order.gather(-1, torch.sort((~candidate.gather(-1, order)).to(torch.int8), dim=-1, stable=True).indices)
    pos = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, pos)
