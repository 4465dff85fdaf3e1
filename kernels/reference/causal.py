"""Teacher-forced block-sparse attention over whole sequences: the trainer's view of a rollout.

For the query at position i the context is L = i + 1 tokens, exactly what the rollout engine had when
it decoded from that position; every query selects its own blocks with the same rule and landmarks
(full blocks only, which are all the candidates since `recent` ≥ 1). A query with budget ≥ its block
count, a prompt position, or a dense layer attends densely with an ordinary causal mask.
"""

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from sparrow.layout import SparseAttentionConfig

from .landmarks import landmarks_from_keys
from .scoring import group_mean_queries, score_landmarks
from .selection import selected_blocks_mask


def causal_rows_mask(positions: torch.Tensor, total: int) -> torch.Tensor:
    """Boolean `[..., T]`: the keys 0 … T-1 a query at each of `positions` may see (those at or before it). Rows of
    a chunked or cached prefill sit at the end of their context, so this is the bottom-right causal mask."""
    return torch.arange(total, device=positions.device) <= positions[..., None]


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
    (post-RoPE) under `budgets: [C]` → boolean `[H_kv, C, T]`: `sparse_causal_mask`'s rows, the others not computed."""
    return rows_keep(q[None], keys[None], positions[None], budgets[None], config)[0].transpose(0, 1)


def rows_keep(
    q: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, budgets: torch.Tensor, config: SparseAttentionConfig
) -> torch.Tensor:
    """Batched `sparse_rows_mask`: queries `q: [B, R, H_q, D]` at `positions: [B, R]` of their row's keys
    `keys: [B, T, H_kv, D]` under `budgets: [B, R]` → boolean `[B, R, H_kv, T]`. The reference decode selection
    (`select_blocks`' rule) picks each query's blocks from its row's full blocks' landmarks."""
    bsz, rows = q.shape[:2]
    total, heads = keys.shape[1], keys.shape[2]
    bs = config.block_size
    max_blocks = -(-total // bs)
    landmarks = landmarks_from_keys(keys, bs, config.landmark)[:, None]  # [B, 1, n_full, H_kv, W]: full blocks only
    scores = score_landmarks(group_mean_queries(q, heads), landmarks, config.landmark)  # [B, R, H_kv, n_full]
    scores = F.pad(scores, (0, max_blocks - scores.shape[-1]), value=float("-inf"))
    keep, _ = selected_blocks_mask(scores.flatten(0, 1), (positions // bs + 1).flatten(), budgets.flatten(),
                                   config.sink, config.recent)
    token_keep = keep.view(bsz, rows, heads, max_blocks).repeat_interleave(bs, dim=-1)[..., :total]
    return token_keep & causal_rows_mask(positions, total)[:, :, None, :]


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


@dataclass(frozen=True)
class SparseRows:
    """The query rows of a right-padded batch that attend sparsely, as index tensors built on the host once per
    forward (so no layer reads anything back from the device): row b's queries first_b … len_b − 1."""

    positions: torch.Tensor
    """`[B, R]` their positions, R the most any row has; a shorter row repeats its last position (computed, dropped)."""
    source: torch.Tensor
    """`[N]` the real entries' indices into the flattened `[B * R]`."""
    target: torch.Tensor
    """`[N]` their indices into the flattened `[B * T]`."""
    prefix: int
    """The positions every row attends densely before: the latest first sparse query (bounded by the length)."""

    @classmethod
    def of(cls, budgets: torch.Tensor, lengths: list[int], config: SparseAttentionConfig,
           device: torch.device | str = "cpu") -> "SparseRows":
        """From a batch's budgets `[B, T]` (read on the host: pass them there) and each row's length before its right
        padding; each row's first sparse query is its `first_sparse_query`."""
        host = budgets.cpu()
        seq_len = host.shape[1]
        if len(lengths) != host.shape[0] or (lengths and max(lengths) > seq_len):
            raise ValueError(f"sparse row lengths {lengths} do not fit a batch of {host.shape[0]} rows of {seq_len} positions")
        firsts = [first_sparse_query(host[b, :n], config) for b, n in enumerate(lengths)]
        width = max((n - f for f, n in zip(firsts, lengths)), default=0)
        positions, source, target = [], [], []
        for b, (f, n) in enumerate(zip(firsts, lengths)):
            count = max(n - f, 0)
            positions.append([f + min(r, count - 1) if count else 0 for r in range(width)])
            source += range(b * width, b * width + count)
            target += range(b * seq_len + f, b * seq_len + f + count)
        as_long = lambda values: torch.tensor(values, dtype=torch.long).to(device)  # noqa: E731
        prefix = max((min(f, n) for f, n in zip(firsts, lengths)), default=0)
        return cls(as_long(positions).view(len(lengths), width), as_long(source), as_long(target), prefix)


def block_sparse_causal_sdpa_batch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    budgets: torch.Tensor,
    rows: SparseRows,
    config: SparseAttentionConfig,
    scale: float | None = None,
) -> torch.Tensor:
    """`block_sparse_causal_attention` for a right-padded batch in SDPA's layout, `q: [B, H_q, T, D]`,
    `k, v: [B, H_kv, T, D]`, `budgets: [B, T]` → `[B, T, H_q, D]`, with the softmax done by SDPA in the inputs' dtype.

    The positions before `rows.prefix` (the latest first sparse query: the prompts) run SDPA's causal kernel (flash
    on a GPU), exact for every query before its row's first sparse query; then only the sparse queries (`rows`) run
    under their keys' mask, `[B, H, R, T]` (SDPA's memory-efficient kernel on a GPU), and take their places. Right
    padding is never attended by a real query, and its outputs are zeros. One call per layer for the whole batch: a
    fixed number of operators, whatever the rows. What the trainer's sparse forward (DistillSparse, exact α) and the
    teacher-forced engine run; the reference stays the definition."""
    bsz, num_q_heads, seq_len, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    cut = rows.prefix
    prefix = F.scaled_dot_product_attention(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut], is_causal=True, scale=scale,
                                            enable_gqa=group > 1)
    out = F.pad(prefix.transpose(1, 2), (0, 0, 0, 0, 0, seq_len - cut))
    width = rows.positions.shape[1]
    if width == 0:
        return out
    batch = torch.arange(bsz, device=q.device)[:, None]
    queries = q.transpose(1, 2)[batch, rows.positions]  # [B, R, H_q, D]
    keep = rows_keep(queries, k.transpose(1, 2), rows.positions, budgets.gather(1, rows.positions), config)
    mask = keep.transpose(1, 2)  # [B, H_kv, R, T]
    if group > 1:  # to the query heads, so a GPU can run the memory-efficient kernel (it takes a mask, not GQA)
        mask, k, v = (t.repeat_interleave(group, dim=1) for t in (mask, k, v))
    sparse = F.scaled_dot_product_attention(queries.transpose(1, 2), k, v, attn_mask=mask, scale=scale)
    picked = sparse.transpose(1, 2).reshape(bsz * width, num_q_heads, head_dim).index_select(0, rows.source)
    merged = out.reshape(bsz * seq_len, num_q_heads, head_dim).index_copy(0, rows.target, picked)
    return merged.view(bsz, seq_len, num_q_heads, head_dim)


def block_sparse_causal_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    budgets: torch.Tensor,
    config: SparseAttentionConfig,
    scale: float | None = None,
    rows: SparseRows | None = None,
) -> torch.Tensor:
    """`block_sparse_causal_sdpa_batch` for one sequence, `q: [T, H_q, D]`, `k, v: [T, H_kv, D]`, `budgets: [T]`
    → `[T, H_q, D]`. `rows` is the sequence's `SparseRows`, passed by a caller that built it once from host budgets
    (finding the first sparse query from device budgets stalls the GPU)."""
    seq_len = k.shape[0]
    if rows is None:
        rows = SparseRows.of(budgets[None], [seq_len], config, q.device)
    layout = lambda t: t.transpose(0, 1)[None]  # noqa: E731
    return block_sparse_causal_sdpa_batch(layout(q), layout(k), layout(v), budgets.to(q.device)[None], rows, config, scale)[0]
