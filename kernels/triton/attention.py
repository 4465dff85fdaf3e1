"""Split-K paged decode attention over per-row block lists, and the LSE merge of the splits.

Grid (rows = B·H_kv, splits). A program owns one KV head of one sequence and a contiguous slice of the
row's block list; the G query heads of that KV head are packed as rows of one [16 × D] tile, so every
K/V byte is read once per KV head and `tl.dot` applies. Each iteration gathers `PPI` (block, head)
tiles of 16 × D contiguous elements (one 16-byte vector per thread per row), computes the logits, and
runs the base-2 online softmax in float32. A row's list is its block table when the context fits the
budget (dense row, or the whole batch in DENSE mode) and the selection kernel's physical ids otherwise;
either way the last entry is the partial current block, whose tokens ≥ seq_len are masked.

FP8 pages (`FP8`): each stored vector has its float32 scale (`sparrow.kernels.reference.kv_quant`). The e4m3
tiles are widened to float16 (exact, one hardware conversion per pair; bfloat16 would take three) and the scales
applied outside the dots: a key's scale multiplies its logit, a value's scale its softmax weight. The query enters
the dot pre-scaled by softmax's scale (|q| · 0.13 stays far inside float16's range), the weights divided by the
tile's largest value scale (≤ 1, so float16 keeps their precision), which multiplies the tile's product back.
An iteration covers twice the blocks of a bfloat16 one (`attention_tiling`), so as many bytes are in flight.
e4m3 needs sm_89+ (Ada, Hopper).

Each split writes its normalized partial output and log2-sum-exp; `merge_splits` combines them. With
one split the program writes the final output directly. Grids depend only on (B, splits), never on
lengths or budgets, so the launches are CUDA-graph capturable with budgets that change every step.
"""

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..reference import KVScales


class AttentionTiling(NamedTuple):
    """Fixed launch configuration per head_dim (no autotuning, so graph capture sees one variant)."""

    blocks_per_iter: int
    num_warps: int
    num_stages: int


def attention_tiling(head_dim: int, fp8: bool = False) -> AttentionTiling:
    """The best of a sweep on an H200 at head_dim 128 (benchmarks/results, docs/performance.md): FP8 pages take twice
    the blocks per iteration (the same bytes per load) and one more stage."""
    if head_dim <= 64:
        tiling = AttentionTiling(blocks_per_iter=8, num_warps=4, num_stages=3)
    elif head_dim <= 128:
        tiling = AttentionTiling(blocks_per_iter=4, num_warps=4, num_stages=2)
    else:
        tiling = AttentionTiling(blocks_per_iter=2, num_warps=8, num_stages=2)
    return tiling._replace(blocks_per_iter=2 * tiling.blocks_per_iter, num_stages=tiling.num_stages + 1) if fp8 else tiling


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_table_ptr, sel_ptr, seq_len_ptr, budget_ptr,
    out_ptr, o_part_ptr, lse_part_ptr, count_ptr,
    stride_qb, stride_qh, stride_bt, stride_sel, stride_ob, stride_oh, stride_cb, stride_ch, stride_ct,
    stride_sb, stride_sh,
    sm_scale_log2, sink, recent, num_splits,
    H: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BS: tl.constexpr, PPI: tl.constexpr, DENSE: tl.constexpr, DIRECT_OUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, VEC: tl.constexpr, WRITE_COUNT: tl.constexpr, FP8: tl.constexpr,
    FP8_DOT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    b = row // H
    h = row % H
    seq_len = tl.load(seq_len_ptr + b).to(tl.int32)
    n = (seq_len + BS - 1) // BS
    # The row's block list is chosen once, not per tile: two masked loads a tile (one always empty) made FP8 sparse
    # layers 19 % slower per token than dense ones (H200, docs/performance.md).
    row_table = block_table_ptr + b * stride_bt
    if DENSE:
        ids_ptr = row_table
        count = n
        if WRITE_COUNT:  # blocks attended, so a dense step needs no extra launches to report them
            tl.store(count_ptr + b, n.to(count_ptr.dtype.element_ty), mask=(h == 0) & (split == 0))
    else:
        budget = tl.maximum(tl.minimum(tl.load(budget_ptr + b), 1 << 30).to(tl.int32), sink + recent)
        ids_ptr = tl.where(n <= budget, row_table, sel_ptr + row * stride_sel)
        count = tl.minimum(n, budget)
    per_split = tl.cdiv(tl.cdiv(count, num_splits), PPI) * PPI
    lo = split * per_split
    hi = tl.minimum(lo + per_split, count)
    last_len = seq_len - (n - 1) * BS

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < G
    q = tl.load(
        q_ptr + b * stride_qb + (h * G + g[:, None]) * stride_qh + d[None, :],
        mask=g_mask[:, None] & (d[None, :] < D), other=0.0,
    )
    if FP8:
        q = (q.to(tl.float32) * sm_scale_log2).to(FP8_DOT)
    else:
        q = q.to(k_cache_ptr.dtype.element_ty)

    tok = tl.arange(0, PPI * BS)
    tok_block = tok // BS
    tok_off = tok % BS
    head_base = h * stride_ch
    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    for start in range(lo, hi, PPI):
        entry = start + tok_block
        in_range = entry < hi
        ids = tl.load(ids_ptr + entry, mask=in_range, other=0).to(tl.int64)
        valid = in_range & ((entry != count - 1) | (tok_off < last_len))
        offs = ids * stride_cb + head_base + tok_off * stride_ct
        if VEC > 1:  # rows start on 16-byte boundaries: one vector load per thread and row
            offs = tl.multiple_of(offs, VEC)
        kv_mask = valid[:, None] & (d[None, :] < D)
        k = tl.load(k_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        # V is issued with K: a sparse split is often one iteration, where a load after the dot waits out a
        # second memory round trip.
        v = tl.load(v_cache_ptr + offs[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP8:
            scale_offs = ids * stride_sb + h * stride_sh + tok_off
            k_scale = tl.load(k_scale_ptr + scale_offs, mask=valid, other=0.0)
            v_scale = tl.load(v_scale_ptr + scale_offs, mask=valid, other=0.0)
            s = tl.dot(q, tl.trans(k.to(FP8_DOT)), input_precision=DOT_PRECISION) * k_scale[None, :]
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * sm_scale_log2
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP8:
            v_top = tl.max(v_scale, axis=0)
            v_top = tl.where(v_top > 0, v_top, 1.0)
            pv = tl.dot((p * (v_scale / v_top)[None, :]).to(FP8_DOT), v.to(FP8_DOT), input_precision=DOT_PRECISION) * v_top
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    has = l_i > 0
    o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
    if DIRECT_OUT:
        out_offs = b * stride_ob + (h * G + g[:, None]) * stride_oh + d[None, :]
        tl.store(out_ptr + out_offs, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & (d[None, :] < D))
    else:
        part = (row * num_splits + split) * G + g
        tl.store(o_part_ptr + part[:, None] * D + d[None, :], o, mask=g_mask[:, None] & (d[None, :] < D))
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(lse_part_ptr + part, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    o_part_ptr, lse_part_ptr, out_ptr,
    stride_ob, stride_oh, num_splits,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One program per (row, query head): all splits are read in one [splits × D] load, so the merge
    costs one memory round trip instead of one per split."""
    pid = tl.program_id(0).to(tl.int64)
    row = pid // G
    g = pid % G
    b = row // H
    h = row % H
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    part = (row * num_splits + sp) * G + g
    lse = tl.load(lse_part_ptr + part, mask=sp < num_splits, other=float("-inf"))
    live = lse > float("-inf")
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    w = tl.where(live, tl.exp2(lse - top), 0.0)
    o = tl.load(o_part_ptr + part[:, None] * D + d[None, :], mask=live[:, None] & (d[None, :] < D), other=0.0)
    acc = tl.sum(w[:, None] * o, axis=0)
    denom = tl.sum(w, axis=0)
    out = tl.where(denom > 0, acc / tl.where(denom > 0, denom, 1.0), 0.0)
    tl.store(out_ptr + b * stride_ob + (h * G + g) * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    o_part: torch.Tensor,
    lse_part: torch.Tensor,
    *,
    scale: float,
    splits: int,
    budgets: torch.Tensor | None = None,
    selected: torch.Tensor | None = None,
    sink: int = 0,
    recent: int = 1,
    tiling: AttentionTiling | None = None,
    counts: torch.Tensor | None = None,
    kv_scales: KVScales | None = None,
) -> None:
    """Attention of `q: [B, H_q, D]` into `out`. Dense when `budgets` is None; otherwise rows with more
    blocks than their budget attend to `selected` (physical ids from `select_blocks`). Dense attention
    also writes each sequence's block count into `counts: [B]` when given. `kv_scales`: the caches are FP8 pages.
    `o_part: [≥B·H_kv·splits·G·D]` and `lse_part: [≥B·H_kv·splits·G]` float32 scratch (unused if splits == 1)."""
    attention_partials(q, k_cache, v_cache, block_tables, seq_lens, out, o_part, lse_part, scale=scale, splits=splits,
                       budgets=budgets, selected=selected, sink=sink, recent=recent, tiling=tiling, counts=counts,
                       kv_scales=kv_scales)
    if splits > 1:
        merge_splits(o_part, lse_part, out, num_kv_heads=k_cache.shape[1], splits=splits)


def attention_partials(q, k_cache, v_cache, block_tables, seq_lens, out, o_part, lse_part, *, scale: float,
                       splits: int, budgets=None, selected=None, sink: int = 0, recent: int = 1,
                       tiling: AttentionTiling | None = None, counts: torch.Tensor | None = None,
                       kv_scales: KVScales | None = None) -> None:
    """The split-K kernel alone: per-split partials (or `out` directly when splits == 1)."""
    bsz, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    fp8 = kv_scales is not None
    tiling = tiling or attention_tiling(head_dim, fp8)
    dense = budgets is None
    if not dense and selected is None:
        raise ValueError("sparse attention (budgets given) needs `selected` from select_blocks")
    write_count = dense and counts is not None
    k_scale, v_scale = (kv_scales.k, kv_scales.v) if fp8 else (lse_part, lse_part)  # placeholders, never read
    _decode_attention_kernel[(bsz * num_kv_heads, splits)](
        q, k_cache, v_cache, k_scale, v_scale, block_tables, block_tables if dense else selected, seq_lens,
        seq_lens if dense else budgets,
        out, o_part, lse_part, counts if write_count else seq_lens,
        q.stride(0), q.stride(1), block_tables.stride(0), 0 if dense else selected.stride(0), out.stride(0), out.stride(1),
        *cache_strides(k_cache, v_cache), *scale_strides(kv_scales, k_cache),
        scale * math.log2(math.e), sink, recent, splits,
        H=num_kv_heads, G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BS=block_size, PPI=tiling.blocks_per_iter,
        DENSE=dense, DIRECT_OUT=splits == 1,
        DOT_PRECISION="ieee" if (q if fp8 else k_cache).dtype == torch.float32 else "tf32",
        VEC=vector_elements(k_cache), WRITE_COUNT=write_count, FP8=fp8,
        FP8_DOT=tl.float32 if q.dtype == torch.float32 else tl.float16,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )


def vector_elements(k_cache: torch.Tensor) -> int:
    """Elements per 16-byte vector when every page row starts on a 16-byte boundary, else 1 (no alignment hint)."""
    vec = 16 // k_cache.element_size()
    aligned = k_cache.data_ptr() % 16 == 0 and all(st % vec == 0 for st in k_cache.stride()[:3])
    return vec if aligned else 1


def cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    """(block, head, token) strides shared by `k_cache` and `v_cache`, `[num_blocks, H_kv, block_size, D]` views
    with a contiguous last dimension. Blocks need not be adjacent: vLLM pages hold a block's K and V together,
    so its K view has block stride 2·H_kv·16·D."""
    if k_cache.stride() != v_cache.stride() or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)}/{k_cache.stride()} and v_cache {tuple(v_cache.shape)}/"
                         f"{v_cache.stride()} need equal shapes and strides")
    if k_cache.stride(3) != 1:
        raise ValueError(f"k_cache strides {k_cache.stride()}: the head_dim dimension must be contiguous (stride 1)")
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


def scale_strides(kv_scales: KVScales | None, k_cache: torch.Tensor) -> tuple[int, int]:
    """(block, head) strides of FP8 scales `[num_blocks, H_kv, block_size]` with contiguous tokens; (0, 0) without."""
    if kv_scales is None:
        return 0, 0
    want = k_cache.shape[:3]
    for name, t in (("k", kv_scales.k), ("v", kv_scales.v)):
        if t.shape != want or t.dtype != torch.float32 or t.stride(2) != 1 or t.stride() != kv_scales.k.stride():
            raise ValueError(f"kv_scales.{name} {tuple(t.shape)} {t.dtype} strides {t.stride()}: expected float32 "
                             f"{tuple(want)} with contiguous tokens, k and v alike")
    if k_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"kv_scales given with a {k_cache.dtype} cache: FP8 pages are torch.float8_e4m3fn")
    return kv_scales.k.stride(0), kv_scales.k.stride(1)


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, *, num_kv_heads: int, splits: int) -> None:
    """Combine the per-split partial outputs by their log-sum-exp into `out: [B, H_q, D]`."""
    bsz, num_q_heads, head_dim = out.shape
    _merge_splits_kernel[(bsz * num_q_heads,)](
        o_part, lse_part, out,
        out.stride(0), out.stride(1), splits,
        H=num_kv_heads, G=num_q_heads // num_kv_heads, D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=triton.next_power_of_2(splits), num_warps=4,
    )
