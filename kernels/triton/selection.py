"""Exact top-k block selection per (sequence, KV head) row with per-row budgets read from device memory.

One program per row holds all of the row's candidate scores in registers. Scores become order-preserving
unsigned keys (NaN lowest, −0 = +0); the k-th largest key is found by bisection, one bit and one int32
sum per pass. Blocks above the threshold are taken, and at the threshold the lowest block indices are
taken first, which is the tie rule. One cumulative sum (two 16-bit fields: ties seen, other kept blocks
seen) then both picks the ties and compacts the kept blocks — sinks, the top-k, the recent blocks — into
the row's list of physical block ids in ascending logical order, so the partial current block is last.

Why this shape (H200 sweeps, benchmarks/select_sweep.py): with one row per program the time is cross-warp
reductions, ~0.19 us per int32 lane reduced, plus ~6.5 us of loads, scans and stores. Every bisection
needs ~32 lane reductions (32 one-bit passes; 16 two-bit passes with three 16-bit counts in two lanes;
8 four-bit passes with 15 counts in eight lanes measured 2x slower), and one bit per pass is the simplest.
The bisection stops at the first threshold exactly k keys reach (the top k are then known; rows with tied keys at
the k-th place still take all 32 passes): about 17 passes for 2048 distinct scores, 1.2-2.8 us faster than the 32
unrolled passes it replaced on an H200 (benchmarks/results/select-variants-nvidia-h200-20261128/).
Rows whose context fits their budget write nothing: attention reads their block table directly.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _select_kernel(
    score_ptr, block_table_ptr, seq_len_ptr, budget_ptr, sel_ptr, count_ptr,
    stride_sr, stride_bt, stride_sel,
    sink, recent, max_blocks,
    H: tl.constexpr, BS: tl.constexpr, NMAX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // H
    h = row % H
    j = tl.arange(0, NMAX)
    # Issued together with the length/budget loads; entries outside the candidates are masked below.
    s = tl.load(score_ptr + row * stride_sr + j, mask=j < max_blocks, other=0.0).to(tl.float32)
    phys = tl.load(block_table_ptr + b * stride_bt + j, mask=j < max_blocks, other=0)
    seq_len = tl.load(seq_len_ptr + b).to(tl.int32)
    budget = tl.maximum(tl.minimum(tl.load(budget_ptr + b), 1 << 30).to(tl.int32), sink + recent)
    n = (seq_len + BS - 1) // BS
    sparse = n > budget
    k = budget - sink - recent
    n_sparse = tl.where(sparse, n, 0)  # scalar conditions folded into bounds
    cand = (j >= sink) & (j < n_sparse - recent)

    s = s + 0.0  # -0 -> +0
    bits = s.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order == float order
    ukey = (key ^ -2147483648).to(tl.uint32, bitcast=True)  # unsigned order == float order; -inf -> 0x007FFFFF
    ukey = tl.where(cand & (s == s), ukey, tl.zeros_like(ukey))  # NaN and non-candidates -> 0, below every score

    # thr = largest value with #(ukey >= thr) >= k, i.e. the k-th largest key (0 when fewer keys are positive).
    thr = tl.zeros([], dtype=tl.uint32)
    # Stop at the first trial that exactly k keys reach: those k are the top k, whatever the lower bits.
    bit = tl.full([], 1 << 31, tl.uint32)
    found = tl.zeros([], dtype=tl.int32)
    while (bit > 0) & (found == 0):
        trial = thr + bit
        reached = tl.sum((ukey >= trial).to(tl.int32), axis=0)
        thr = tl.where(reached >= k, trial, thr)
        found = (reached == k).to(tl.int32)
        bit = bit >> 1

    above = ukey > thr  # candidates only (non-candidates have key 0 <= thr); fewer than k of them
    at = (ukey == thr) & cand
    need = k - tl.sum(above.to(tl.int32), axis=0)  # ties to take, lowest block index first
    reserved = ((j < sink) | (j >= n_sparse - recent)) & (j < n_sparse)
    first = above | reserved  # disjoint: reserved blocks are never candidates
    seen = tl.cumsum(at.to(tl.int32) + (first.to(tl.int32) << 16), axis=0)  # fields < 2^15 (NMAX <= 16384)
    ties_seen = seen & 0xFFFF
    keep = first | (at & (ties_seen <= need))
    pos = (seen >> 16) + tl.minimum(ties_seen, need) - 1
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
    num_warps: int | None = None,
) -> None:
    """Write the physical ids of each sparse row's blocks into `selected: [B·H_kv, ≥M]` (int32), and
    `counts: [B]` = min(blocks, budget) for every sequence. Dense rows' entries are left as they were.
    `num_warps` (default: the best of the H200 sweep for the width) only changes the speed."""
    bsz, max_blocks = block_tables.shape
    if recent < 1:
        raise ValueError(f"recent={recent}: must be >= 1 so the partial block is the last entry of every row")
    nmax = max(16, triton.next_power_of_2(max_blocks))
    if nmax > 1 << 14:
        raise ValueError(f"{max_blocks} blocks per sequence: the selection kernel holds at most 16384 per row")
    _select_kernel[(bsz * num_kv_heads,)](
        scores, block_tables, seq_lens, budgets, selected, counts,
        scores.stride(0), block_tables.stride(0), selected.stride(0),
        sink, recent, max_blocks,
        H=num_kv_heads, BS=block_size, NMAX=nmax,
        num_warps=num_warps or max(4, min(8, nmax // 256)),
    )
