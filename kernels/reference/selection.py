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
    rule = _Rule(scores, num_blocks, budgets, sink, recent)
    chosen = _chosen(scores, rule)
    pos, n = rule.pos, rule.num_blocks
    reserved = (pos[None, :] < sink) | (pos[None, :] >= (n - recent)[:, None])
    keep = (reserved & (pos[None, :] < n[:, None]))[:, None, :] | chosen
    keep = keep | (rule.dense[:, None, None] & (pos[None, None, :] < n[:, None, None]))
    return keep, rule.counts


def chosen_candidates(
    scores: torch.Tensor,
    num_blocks: torch.Tensor,
    budgets: torch.Tensor,
    sink: int,
    recent: int,
) -> torch.Tensor:
    """The part of the choice made by score, `[B, H_kv, M]`: the top-k candidates (none on a dense row)."""
    return _chosen(scores, _Rule(scores, num_blocks, budgets, sink, recent))


def _chosen(scores: torch.Tensor, rule: "_Rule") -> torch.Tensor:
    rank = candidate_rank(scores, rule.candidate[:, None, :].expand_as(scores))
    return rule.candidate[:, None, :] & (rank < rule.k_row[:, None, None])


def choice_margin(
    scores: torch.Tensor,
    num_blocks: torch.Tensor,
    budgets: torch.Tensor,
    sink: int,
    recent: int,
) -> torch.Tensor:
    """How near each row's top-k choice came to another one: the score gap between the last candidate chosen and
    the first left out, over the candidates' score range, `[B, H_kv]` (0 = a tie; inf where no candidate was left
    out or none chosen). Two runs whose choices part where this is tiny flipped a near-tie, not a real difference."""
    rule = _Rule(scores, num_blocks, budgets, sink, recent)
    candidate = rule.candidate[:, None, :].expand_as(scores)
    ranked = torch.nan_to_num(scores.double(), nan=float("-inf")).masked_fill(~candidate, float("-inf"))
    ordered = torch.sort(ranked, dim=-1, descending=True).values
    in_play = candidate.sum(-1)
    k = rule.k_row[:, None].expand_as(in_play)
    last_in = ordered.gather(-1, (k - 1).clamp(min=0)[..., None])[..., 0]
    first_out = ordered.gather(-1, k.clamp(max=scores.shape[-1] - 1)[..., None])[..., 0]
    spread = ordered[..., 0] - ordered.gather(-1, (in_play - 1).clamp(min=0)[..., None])[..., 0]
    margin = (last_in - first_out) / spread.clamp(min=torch.finfo(torch.float64).tiny)
    return torch.where((k >= 1) & (k < in_play), margin, float("inf"))


class _Rule:
    """The selection rule's per-row quantities: candidates [sink, n − recent), top-k size, counts, dense rows."""

    def __init__(self, scores, num_blocks, budgets, sink: int, recent: int):
        if recent < 1:
            raise ValueError(f"recent={recent}: must be >= 1 (the partial block has no landmark)")
        device = scores.device
        self.num_blocks = num_blocks.long().to(device)
        budgets = torch.maximum(budgets.long().to(device), torch.full_like(self.num_blocks, sink + recent))
        self.counts = torch.minimum(self.num_blocks, budgets)
        self.dense = self.num_blocks <= budgets
        self.k_row = torch.where(self.dense, 0, budgets - sink - recent)
        self.pos = torch.arange(scores.shape[-1], device=device)
        self.candidate = (self.pos[None, :] >= sink) & (self.pos[None, :] < (self.num_blocks - recent)[:, None])


def candidate_rank(scores: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """Rank of every position along the last dim: candidates first, by descending score (NaN last),
    ties to the lower index; non-candidates after all candidates."""
    ranked = torch.nan_to_num(scores.double(), nan=float("-inf"), posinf=float("inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    order = order.gather(-1, torch.sort((~candidate.gather(-1, order)).to(torch.int8), dim=-1, stable=True).indices)
    pos = torch.arange(scores.shape[-1], device=scores.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, pos)
