"""Block scores: ⟨mean of the GQA group's queries, landmark⟩ per (sequence, KV head, block).

Sparrow averages the G query heads that share a KV head and takes one dot product with each block's
mean key; no softmax or 1/√d, which would not change the ranking. In min/max mode the score is
Quest's upper bound Σ_d max(q̄_d·kmax_d, q̄_d·kmin_d) ≥ max over the block's keys of ⟨q̄, k⟩. `mean_int8`
landmarks are scored as the mean keys they dequantize to.
"""

import torch

from .landmarks import decode_landmarks


def group_mean_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """`q: [..., H_q, D]` → `[..., H_kv, D]`; query head h belongs to KV head h // G (HF repeat_kv)."""
    *lead, hq, d = q.shape
    acc = torch.promote_types(q.dtype, torch.float32)
    return q.to(acc).reshape(*lead, num_kv_heads, hq // num_kv_heads, d).mean(dim=-2)


def score_landmarks(q_mean: torch.Tensor, landmarks: torch.Tensor, mode: str) -> torch.Tensor:
    """Scores of `landmarks: [..., N, H_kv, W]` against `q_mean: [..., H_kv, D]` → `[..., H_kv, N]`."""
    lm = decode_landmarks(landmarks, mode, q_mean.shape[-1]).to(q_mean.dtype)
    if mode in ("mean", "mean_int8"):
        return torch.einsum("...hd,...nhd->...hn", q_mean, lm)
    d = q_mean.shape[-1]
    kmax, kmin = lm[..., :d], lm[..., d:]
    qe = q_mean.unsqueeze(-3)  # [..., 1, H, D]
    return torch.maximum(qe * kmax, qe * kmin).sum(-1).transpose(-1, -2)


def score_paged_blocks(
    q: torch.Tensor,
    landmarks: torch.Tensor,
    block_tables: torch.Tensor,
    num_blocks: torch.Tensor,
    mode: str = "mean",
) -> torch.Tensor:
    """Decode-time scores for a batch.

    `q: [B, H_q, D]`, `landmarks: [num_physical_blocks, H_kv, W]`, `block_tables: [B, M]` logical →
    physical, `num_blocks: [B]` blocks in use per sequence. Returns `[B, H_kv, M]` scores in float32
    or wider; entries at or beyond a sequence's block count are -inf.
    """
    num_kv_heads = landmarks.shape[1]
    q_mean = group_mean_queries(q, num_kv_heads)
    gathered = landmarks[block_tables.long().clamp(min=0)]  # [B, M, H_kv, W]
    scores = score_landmarks(q_mean, gathered, mode)
    in_use = torch.arange(block_tables.shape[1], device=q.device)[None, :] < num_blocks[:, None]
    return scores.masked_fill(~in_use[:, None, :], float("-inf"))
