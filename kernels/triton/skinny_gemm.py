"""`y = x · Wᵀ` for decode-sized batches (M ≤ 64 rows): a weight-streaming GEMM.

At rollout batch sizes a projection is a pass over its weight matrix (8 × 2048 activations against 2048 ×
12288 weights): its cost is the weight bytes over the memory bandwidth. One program owns `BN` output
columns for all M rows and streams its `BN × K` slice of W through `BK`-wide, software-pipelined tiles;
the activations (a few KB) stay in L2. `tl.dot` with fp32 accumulation; the output is rounded once.
"""

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_ROWS = 64


class GemmTiling(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


DEFAULT_TILING = GemmTiling(block_n=32, block_k=256, num_warps=4, num_stages=4)


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    m = tl.arange(0, BM)
    kk = tl.arange(0, BK)
    n_mask = n < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + kk
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_wn + k[None, :], mask=n_mask[:, None] & (k[None, :] < K),
                    other=0.0)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0)
        acc += tl.dot(x, tl.trans(w))
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m[:, None] * stride_ym + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & n_mask[None, :])


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  tiling: GemmTiling = DEFAULT_TILING) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for `x: [M ≤ 64, K]` with contiguous rows and a row-major `weight: [N, K]`."""
    rows, k_dim = x.shape
    n_dim = weight.shape[0]
    if rows > MAX_ROWS or weight.shape[1] != k_dim or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} / weight {tuple(weight.shape)}: need M <= {MAX_ROWS} rows, a shared "
                         "contiguous K dimension")
    y = torch.empty(rows, n_dim, dtype=x.dtype, device=x.device)
    if rows == 0:
        return y
    _skinny_gemm_kernel[(triton.cdiv(n_dim, tiling.block_n),)](
        x, weight, weight if bias is None else bias, y, rows, n_dim, k_dim, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BM=max(16, triton.next_power_of_2(rows)), BN=tiling.block_n, BK=tiling.block_k,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages,
    )
    return y
