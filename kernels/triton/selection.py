"""Exact top-k block selection per (sequence, KV head) row with per-row budgets read from device memory.

One program per row holds all of the row's candidate scores in registers. Scores become order-preserving
unsigned keys (NaN lowest, −0 = +0); the k-th largest key is found by a bisection over `BITS` bits per
pass whose 2^BITS − 1 counts share one tree reduction (16-bit fields packed in integer lanes): 16 passes of
2 bits or 8 passes of 4 bits, a trade of work per pass against cross-warp synchronisations. Blocks above the
threshold are taken, and at the threshold the lowest block indices are taken first, which is the tie
rule. A cumulative sum then compacts the kept blocks — sinks, the top-k, the recent blocks — into the
row's list of physical block ids in ascending logical order, so the partial current block is last.
Rows whose context fits their budget write nothing: attention reads their block table directly.
"""

import torch
import triton
import triton.language as tl

SELECT_BITS = 2  # bits per bisection pass by default

@triton.jit
def _add_pair(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _add_quad(a0, b0, c0, d0, a1, b1, c1, d1):
    return a0 + a1, b0 + b1, c0 + c1, d0 + d1


@triton.jit
def _ge_fields(ukey, thr, unit, first: tl.constexpr, count: tl.constexpr):
    """#(ukey >= thr + i·unit) for i = first .. first+count−1, packed as 16-bit fields of an int64 lane."""
    lane = tl.zeros(ukey.shape, dtype=tl.int64)
    for f in tl.static_range(count):
        lane += (ukey >= thr + (first + f) * unit).to(tl.int64) << (16 * f)
    return lane


@triton.jit
def _fields_reaching(lane, k, count: tl.constexpr):
    """How many of a reduced lane's `count` fields are >= k."""
    n = tl.zeros([], dtype=tl.int32)
    for f in tl.static_range(count):
        n += (((lane >> (16 * f)) & 0xFFFF) >= k).to(tl.int32)
    return n


@triton.jit
def _select_kernel(
    score_ptr, block_table_ptr, seq_len_ptr, budget_ptr, sel_ptr, count_ptr,
    stride_sr, stride_bt, stride_sel,
    sink, recent, max_blocks,
    H: tl.constexpr, BS: tl.constexpr, NMAX: tl.constexpr, BITS: tl.constexpr,
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

    # thr = largest value with #(ukey >= thr) >= k, i.e. the k-th largest key; the counts of a pass travel
    # in one tree reduction (16-bit fields, NMAX <= 16384).
    thr = tl.zeros([], dtype=tl.uint32)
    if BITS == 2:
        for p in tl.static_range(16):
            unit = tl.full([], 1 << (30 - 2 * p), tl.uint32)
            t1 = thr + unit
            t2 = t1 + unit
            t3 = t2 + unit
            lanes = (ukey >= t1).to(tl.int32) + ((ukey >= t2).to(tl.int32) << 16)
            c12, c3 = tl.reduce(((lanes, (ukey >= t3).to(tl.int32))), 0, _add_pair)
            step = ((c12 & 0xFFFF) >= k).to(tl.int32) + ((c12 >> 16) >= k).to(tl.int32) + (c3 >= k).to(tl.int32)
            thr = thr + step.to(tl.uint32) * unit
    else:  # 4 bits: 15 thresholds thr + i·unit in four int64 lanes of four fields (the last holds three)
        for p in tl.static_range(8):
            unit = tl.full([], 1 << (28 - 4 * p), tl.uint32)
            l0, l1, l2, l3 = tl.reduce(
                (_ge_fields(ukey, thr, unit, 1, 4), _ge_fields(ukey, thr, unit, 5, 4),
                 _ge_fields(ukey, thr, unit, 9, 4), _ge_fields(ukey, thr, unit, 13, 3)), 0, _add_quad)
            step = (_fields_reaching(l0, k, 4) + _fields_reaching(l1, k, 4) + _fields_reaching(l2, k, 4)
                    + _fields_reaching(l3, k, 3))
            thr = thr + step.to(tl.uint32) * unit

    above = ukey > thr  # 0-keys never: thr >= 0
    at = ((ukey == thr) & cand).to(tl.int32)
    need = k - tl.sum(above.to(tl.int32), axis=0)
    take = above | ((at != 0) & (tl.cumsum(at, axis=0) <= need))  # ties: lowest block index first
    reserved = ((j < sink) | (j >= n_sparse - recent)) & (j < n_sparse)
    keep = take | reserved  # take is empty outside the candidates
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
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
    bits: int = SELECT_BITS,
    num_warps: int | None = None,
) -> None:
    """Write the physical ids of each sparse row's blocks into `selected: [B·H_kv, ≥M]` (int32), and
    `counts: [B]` = min(blocks, budget) for every sequence. Dense rows' entries are left as they were.
    `bits` per bisection pass (2 or 4) and `num_warps` (default from the width) only change the speed."""
    bsz, max_blocks = block_tables.shape
    if recent < 1:
        raise ValueError(f"recent={recent}: must be >= 1 so the partial block is the last entry of every row")
    nmax = max(16, triton.next_power_of_2(max_blocks))
    if nmax > 1 << 14:
        raise ValueError(f"{max_blocks} blocks per sequence: the selection kernel holds at most 16384 per row")
    if bits not in (2, 4):
        raise ValueError(f"bits={bits}: the bisection takes 2 or 4 bits per pass")
    _select_kernel[(bsz * num_kv_heads,)](
        scores, block_tables, seq_lens, budgets, selected, counts,
        scores.stride(0), block_tables.stride(0), selected.stride(0),
        sink, recent, max_blocks,
        H=num_kv_heads, BS=block_size, NMAX=nmax, BITS=bits,
        num_warps=num_warps or max(4, min(16, nmax // 256)),
    )
