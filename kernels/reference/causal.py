"""Teacher-forced block-sparse attention over whole sequences: the trainer's view of a rollout.

For the query at position i the context is L = i + 1 tokens, exactly what the rollout engine had when
it decoded from that position; every query selects its own blocks with the same rule and landmarks
(full blocks only, which are all the candidates since `recent` ≥ 1). A query with budget ≥ its block
count, a prompt position, or a dense layer attends densely with an ordinary causal mask.
"""

import torch
from torch.nn import functional as F

from sparrow.layout import SparseAttentionConfig

from .landmarks import landmarks_from_keys
from .scoring import group_mean_queries, score_landmarks
from .selection import select_blocks


def sparse_causal_mask(
    q: torch.Tensor,
    k: torch.Tensor,
    budgets: torch.Tensor,
    config: SparseAttentionConfig,
) -> torch.Tensor:
    """Boolean `[H_kv, T, T]` mask of the keys each query may attend to.

    `q: [T, H_q, D]`, `k: [T, H_kv, D]` (post-RoPE), `budgets: [T]` total blocks per query
    (use a value ≥ ceil(T / block_size) for dense positions).
    """
    return sparse_rows_mask(q, k, torch.arange(k.shape[0], device=q.device), budgets.to(q.device), config)


def sparse_rows_mask(
    q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, budgets: torch.Tensor, config: SparseAttentionConfig
) -> torch.Tensor:
    """The keys each query `q: [C, H, D]` at `positions` may attend to in the context `keys: [T, H_kv, D]`
    (post-RoPE) under `budgets: [C]` → boolean `[H_kv, C, T]`: `sparse_causal_mask`'s rows, the others not computed.
    The reference decode selection (`select_blocks`) picks each row's blocks from its full blocks' landmarks."""
    bs = config.block_size
    total = keys.shape[0]
    max_blocks = -(-total // bs)
    landmarks = landmarks_from_keys(keys, bs, config.landmark)  # full blocks only
    scores = score_landmarks(group_mean_queries(q, keys.shape[1]), landmarks, config.landmark)  # [C, H_kv, n_full]
    scores = F.pad(scores, (0, max_blocks - scores.shape[-1]), value=float("-inf"))
    block_ids, _ = select_blocks(scores, positions // bs + 1, budgets, config.sink, config.recent)
    keep = torch.zeros(*block_ids.shape[:2], max_blocks + 1, dtype=torch.bool, device=q.device)
    keep.scatter_(-1, torch.where(block_ids >= 0, block_ids, max_blocks), True)
    token_keep = keep[..., :max_blocks].repeat_interleave(bs, dim=-1)[..., :total]  # [C, H_kv, T]
    causal = torch.arange(total, device=q.device)[None, :] <= positions[:, None]
    return (token_keep & causal[:, None, :]).transpose(0, 1)


def block_sparse_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    budgets: torch.Tensor,
    config: SparseAttentionConfig,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention of `q: [T, H_q, D]` over `k, v: [T, H_kv, D]` under `sparse_causal_mask`."""
    seq_len, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = head_dim**-0.5 if scale is None else scale
    mask = sparse_causal_mask(q, k, budgets, config)  # [H_kv, T, T]
    qg = q.to(acc).view(seq_len, num_kv_heads, group, head_dim)
    logits = torch.einsum("thgd,shd->hgts", qg, k.to(acc)) * scale
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    out = torch.einsum("hgts,shd->thgd", torch.softmax(logits, dim=-1), v.to(acc))
    return out.reshape(seq_len, num_q_heads, head_dim).to(q.dtype)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None, causal: bool = False,
         scale: float | None = None) -> torch.Tensor:
    """`q: [C, H, D]` over `k, v: [T, H_kv, D]`; `mask: [H_kv or 1, C, T]` boolean (True = attend).

    With a mask the keys and values are repeated to the query heads rather than passed with `enable_gqa`, so a GPU
    can run the memory-efficient kernel (which takes a mask, keeps no [C, T] logits and has a backward)."""
    group = q.shape[1] // k.shape[1]
    if mask is not None:
        if mask.shape[0] > 1:
            mask = mask.repeat_interleave(group, dim=0)
        mask = mask[None]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            group = 1
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=group > 1,
    )
    return out[0].transpose(0, 1)


def first_sparse_query(budgets: torch.Tensor, config: SparseAttentionConfig) -> int:
    """The first position whose budget is below its context's block count (`len(budgets)` when none is): the rows
    before it attend densely. On a host tensor this costs no device synchronisation."""
    blocks = torch.arange(budgets.shape[0], device=budgets.device) // config.block_size + 1
    sparse = blocks > budgets.long().clamp(min=config.reserved_blocks)
    return int(sparse.long().argmax()) if bool(sparse.any()) else budgets.shape[0]


def block_sparse_causal_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    budgets: torch.Tensor,
    config: SparseAttentionConfig,
    scale: float | None = None,
    first: int | None = None,
) -> torch.Tensor:
    """`block_sparse_causal_attention` with the softmax done by SDPA in the inputs' dtype: the same keys per query,
    no float32 `[H_q, T, T]` logits (the reference keeps them for its backward). The rows before the first sparse
    query (a prompt) attend causally among themselves, so they run SDPA's causal kernel (flash on a GPU); only the
    rows from there on are masked, `[H_kv, T - first, T]`. What the teacher-forced engine and the trainer's sparse
    forward (DistillSparse) run; the reference stays the definition. `first` is `first_sparse_query(budgets)`, passed
    by a caller that has it from host budgets (finding it from device budgets stalls the GPU twice per call)."""
    seq_len = k.shape[0]
    first = first_sparse_query(budgets, config) if first is None else first
    parts = []
    if first:
        parts.append(sdpa(q[:first], k[:first], v[:first], causal=True, scale=scale))
    if first < seq_len:
        positions = torch.arange(first, seq_len, device=q.device)
        mask = sparse_rows_mask(q[first:], k, positions, budgets[first:].to(q.device), config)
        parts.append(sdpa(q[first:], k, v, mask, scale=scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)
