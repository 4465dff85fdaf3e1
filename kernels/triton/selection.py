"""Exact top-k block selection per (sequence, KV head) row with per-row budgets read from device memory.

One program per row holds all of the row's candidate scores in registers. Scores become order-preserving
integer keys (NaN lowest, −0 = +0); the k-th largest key is found by a 2-bits-per-pass bisection whose
three counts per pass are packed into one int64 reduction (16 reductions in all); blocks above the
threshold are taken, and at the threshold the lowest block indices are taken first, which is the tie
rule. A cumulative sum then compacts the kept blocks — sinks, the top-k, the recent blocks — into the
row's list of physical block ids in ascending logical order, so the partial current block is last.
Rows whose context fits their budget write nothing: attention reads their block table directly.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _select_kernel(
    score_ptr, block_table_ptr, seq_len_ptr, budget_ptr, sel_ptr, count_ptr,
    stride_sr, stride_bt, stride_sel,
    sink, recent,
    H: tl.constexpr, BS: tl.constexpr, NMAX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // H
    h = row % H
    seq_len = tl.load(seq_len_ptr + b).to(tl.int32)
    n = (seq_len + BS - 1) // BS
    budget = tl.maximum(tl.load(budget_ptr + b).to(tl.int32), sink + recent)
    sparse = n > budget
    k = budget - sink - recent

    j = tl.arange(0, NMAX)
    n_sparse = tl.where(sparse, n, 0)  # scalar conditions folded into bounds
    cand = (j >= sink) & (j < n_sparse - recent)
    s = tl.load(score_ptr + row * stride_sr + j, mask=cand, other=0.0).to(tl.float32) + 0.0  # -0 -> +0
    bits = s.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order == float order
    key = tl.where(s != s, -2147483648, key)  # NaN ranks last
    ukey = tl.where(cand, key.to(tl.int64) - (-2147483648), -1)  # in [0, 2^32); non-candidates never count

    # thr = largest value with #(ukey >= thr) >= k, i.e. the k-th largest key; 2 bits per pass.
    thr = tl.zeros([], dtype=tl.int64)
    for p in tl.static_range(16):
        unit = tl.full([], 1, tl.int64) << (30 - 2 * p)
        t1 = thr + unit
        t2 = thr + 2 * unit
        t3 = thr + 3 * unit
        packed = (ukey >= t1).to(tl.int64) + ((ukey >= t2).to(tl.int64) << 20) + ((ukey >= t3).to(tl.int64) << 40)
        total = tl.sum(packed, axis=0)
        c1 = total & 0xFFFFF
        c2 = (total >> 20) & 0xFFFFF
        c3 = total >> 40
        step = (c1 >= k).to(tl.int64) + (c2 >= k).to(tl.int64) + (c3 >= k).to(tl.int64)
        thr = thr + step * unit

    above = ukey > thr
    at = (ukey == thr).to(tl.int32)
    need = k - tl.sum(above.to(tl.int32), axis=0)
    take = above | ((at != 0) & (tl.cumsum(at, axis=0) <= need))
    reserved = ((j < sink) | (j >= n_sparse - recent)) & (j < n_sparse)
    keep = take | reserved  # take is empty outside the candidates
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    phys = tl.load(block_table_ptr + b * stride_bt + j, mask=keep, other=0)
    tl.store(sel_ptr + row * stride_sel + pos, phys.to(tl.int32), mask=keep)
    tl.store(count_ptr + b, tl.minimum(n, budget).to(count_ptr.dtype.element_ty), mask=h == 0)


def select_blocks(
    scores: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    budgets: torch.Tensor,
    selected: torch.Tensor,
    counts: torch.Tensor,
    *,
    num_kv_heads: int,
    block_size: int,
    sink: int,
    recent: int,
) -> None:
    """Write the physical ids of each sparse row's blocks into `selected: [B·H_kv, ≥M]` (int32), and
    `counts: [B]` = min(blocks, budget) for every sequence. Dense rows' entries are left as they were."""
    bsz, max_blocks = block_tables.shape
    if recent < 1:
        raise ValueError(f"recent={recent}: must be >= 1 so the partial block is the last entry of every row")
    nmax = max(16, triton.next_power_of_2(max_blocks))
    if nmax > 1 << 19:
        raise ValueError(f"{max_blocks} blocks per sequence: the selection kernel holds at most 2^19 per row")
    _select_kernel[(bsz * num_kv_heads,)](
        scores, block_tables, seq_lens, budgets, selected, counts,
        scores.stride(0), block_tables.stride(0), selected.stride(0),
        sink, recent,
        H=num_kv_heads, BS=block_size, NMAX=nmax,
        num_warps=max(4, min(16, nmax // 256)),
    )
