"""Fused elementwise kernels for the model's decode step on CUDA (CPU under TRITON_INTERPRET=1 for tests).

At rollout batch sizes a decode layer's non-GEMM work is a few KB per kernel, so its cost is the number
of launches: Qwen3's q/k RMSNorm plus rotate-half RoPE is 12 kernels per layer in eager PyTorch, the
SiLU gate 2, and the residual add + RMSNorm between sublayers 2 more (twice per layer). Here they are one
kernel each, with the same arithmetic as the unfused ops up to rounding
(normalisation in float32, the normalised value rounded to the activation dtype as F.rms_norm returns
it, cos/sin rounded to it as the unfused path casts them, one rounding of the rotated result).
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, qo_ptr, ko_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_cn, stride_sn, eps,
    H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    half = D // 2
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    m = d < D
    is_q = head < H
    h = tl.where(is_q, head, head - H).to(tl.int64)
    src_q = q_ptr + n * stride_qn + h * stride_qh
    src_k = k_ptr + n * stride_kn + h * stride_kh
    mq = d < tl.where(is_q, D, 0)  # which tensor a program reads is folded into bounds (portable to the interpreter)
    mk = d < tl.where(is_q, 0, D)
    x = tl.load(src_q + d, mask=mq, other=0.0).to(tl.float32) + tl.load(src_k + d, mask=mk, other=0.0).to(tl.float32)
    xp = (tl.load(src_q + partner, mask=mq, other=0.0).to(tl.float32)
          + tl.load(src_k + partner, mask=mk, other=0.0).to(tl.float32))
    out_dtype = qo_ptr.dtype.element_ty
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
        w = tl.load(qw_ptr + d, mask=mq, other=0.0).to(tl.float32) + tl.load(kw_ptr + d, mask=mk, other=0.0).to(tl.float32)
        wp = (tl.load(qw_ptr + partner, mask=mq, other=0.0).to(tl.float32)
              + tl.load(kw_ptr + partner, mask=mk, other=0.0).to(tl.float32))
        x = (x * rstd * w).to(out_dtype).to(tl.float32)
        xp = (xp * rstd * wp).to(out_dtype).to(tl.float32)
    c = tl.load(cos_ptr + n * stride_cn + d, mask=m, other=0.0).to(out_dtype).to(tl.float32)
    s = tl.load(sin_ptr + n * stride_sn + d, mask=m, other=0.0).to(out_dtype).to(tl.float32)
    out = (x * c + sign * xp * s).to(out_dtype)
    tl.store(qo_ptr + (n * H + h) * D + d, out, mask=mq)
    tl.store(ko_ptr + (n * HKV + h) * D + d, out, mask=mk)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                 cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of each head (when weights are given, Qwen3) then rotate-half RoPE, for `q: [N, H, D]` and
    `k: [N, H_kv, D]` (any row/head strides, contiguous D) with `cos, sin: [N, D]` or `[N, 1, D]` rows of
    the position tables. Returns contiguous `q, k`."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if head_dim % 2 or k.shape[2] != head_dim or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"q {tuple(q.shape)} / k {tuple(k.shape)}: need an even, contiguous head_dim shared by both")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both q and k norm weights, or neither")
    cos, sin = cos.reshape(num_tokens, head_dim), sin.reshape(num_tokens, head_dim)
    q_out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    k_out = torch.empty(num_tokens, num_kv_heads, head_dim, dtype=k.dtype, device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    norm = q_weight is not None
    _qk_norm_rope_kernel[(num_tokens, num_q_heads + num_kv_heads)](
        q, k, q_out, k_out, q_weight if norm else q, k_weight if norm else k, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0), float(eps),
        H=num_q_heads, HKV=num_kv_heads, D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), NORM=norm, num_warps=1,
    )
    return q_out, k_out


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_xn, inter, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = i < inter
    gate = tl.load(x_ptr + n * stride_xn + i, mask=m, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + n * stride_xn + inter + i, mask=m, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + n * inter + i, (act * up).to(dtype), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for `gate_up: [N, 2·I]` (gate first, the output of a fused gate/up projection) → `[N, I]`."""
    num_tokens, width = gate_up.shape
    if width % 2 or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up {tuple(gate_up.shape)}: need [N, 2*I] with contiguous rows")
    inter = width // 2
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(num_tokens, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), inter, BLOCK=block,
                                                              num_warps=4)
    return out


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, w_ptr, x_out_ptr, out_ptr, stride_x, stride_d, hidden, eps,
                         ADD: tl.constexpr, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + n * stride_x + i, mask=m, other=0.0)
    w = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
    if ADD:
        x = (x.to(tl.float32) + tl.load(delta_ptr + n * stride_d + i, mask=m, other=0.0).to(tl.float32)).to(dtype)
        tl.store(x_out_ptr + n * hidden + i, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    tl.store(out_ptr + n * hidden + i, (xf * rstd * w).to(dtype), mask=m)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream's `x + delta` (rounded to the activation dtype, as the unfused add is) and its
    RMSNorm (float32 statistics, one rounding of `x · rstd · w`), for `x, delta: [N, hidden]` with
    contiguous rows. `delta=None` only normalises (the first layer); then the returned stream is `x`."""
    num_tokens, hidden = x.shape
    if x.stride(1) != 1 or (delta is not None and (delta.shape != x.shape or delta.stride(1) != 1)):
        raise ValueError(f"x {tuple(x.shape)} / delta {None if delta is None else tuple(delta.shape)}: "
                         "need equal [N, hidden] shapes with contiguous rows")
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    x_out = x if delta is None else torch.empty_like(out)
    if num_tokens == 0:
        return x_out, out
    block = triton.next_power_of_2(hidden)
    _add_rms_norm_kernel[(num_tokens,)](
        x, x if delta is None else delta, weight, x_out, out, x.stride(0), 0 if delta is None else delta.stride(0),
        hidden, float(eps), ADD=delta is not None, BLOCK=block, num_warps=max(1, min(16, block // 256)),
    )
    return x_out, out
