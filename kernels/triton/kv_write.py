"""KV-cache write fused with landmark maintenance (decode append and prefill write, one kernel).

One program per (token, KV head) stores the token's key and value into its slot of the HND paged cache.
The program whose token is the last one this call writes into a block also refreshes that block's
landmark: the mean key once the block is full (mode 1), or the channel-wise max ‖ min of the keys
written so far (mode 2). The block's keys come from this call's inputs where they were written in this
call and from the cache otherwise, so no program waits for another program's stores.

Contract (true for decode, prefill and chunked prefill): tokens written into the same block by one call
are consecutive in `slots`, in increasing offset order. Slots < 0 are skipped (CUDA-graph padding).

FP8 pages (`FP8`): each key and value is stored in e4m3 with its float32 scale, the largest element mapped
to 448 (`sparrow.kernels.reference.kv_quant`, bit for bit); landmarks come from the keys as stored.

Int8 mean landmarks (mode 3, `landmark: mean_int8`): the float32 mean rounded to int8 with its float32 scale, the
largest element mapped to 127, written as the row's first D bytes and, through a float32 view of the same tensor,
the 4 after them (`sparrow.kernels.reference.landmarks.encode_mean`; the padding stays as allocated, zero; the mean's
summation order may differ, so an element can land one step away).
"""

import torch
import triton
import triton.language as tl

from sparrow.layout import SparseAttentionConfig

from ..reference import KVScales, check_landmark_dtype
from ..reference.kv_quant import INV_FP8_MAX
from ..reference.landmarks import INT8_MAX, INV_INT8_MAX
from .attention import cache_strides, scale_strides

MODE_NONE, MODE_MEAN, MODE_MINMAX, MODE_MEAN_INT8 = 0, 1, 2, 3
_MODE_IDS = {"mean": MODE_MEAN, "minmax": MODE_MINMAX, "mean_int8": MODE_MEAN_INT8}
_INV_FP8_MAX = tl.constexpr(INV_FP8_MAX)
_INV_INT8_MAX = tl.constexpr(INV_INT8_MAX)
_INT8_MAX = tl.constexpr(float(INT8_MAX))
_ROUND_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: adding and subtracting it rounds |y| < 2^22 half to even


@triton.jit
def _e4m3_grid(y):
    """float32 `y` (|y| <= 448) rounded to the nearest e4m3 value, ties to even, still float32, so its cast to e4m3
    is exact. The cast alone would do on a GPU; Triton 3.9's interpreter (the CPU tests) drops the carry of a cast
    that rounds up into the next power of two (1.97 -> 1.0, 31.5 -> 16.0)."""
    bits = y.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)  # 3 mantissa bits
    magnitude = (tl.abs(y) + 24576.0) - 24576.0  # 1.5 * 2^14: rounds to a multiple of 2^-9, e4m3's subnormal step
    # the sign put back by its bit: a negation compiles to 0 - x on the GPU, which turns -0.0 into +0.0
    subnormal = (magnitude.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(y) < 0.015625, subnormal, normal)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, lm_ptr, lm_scale_ptr,
    num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ch, stride_ct, stride_sb, stride_sh,
    H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr, MODE: tl.constexpr, FP8: tl.constexpr,
    LM_W: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    live = slot >= 0
    blk = tl.where(live, slot, 0) // BS
    off = tl.where(live, slot, 0) % BS
    d = tl.arange(0, BLOCK_D)
    dm = d < tl.where(live, D, 0)  # (scalar conditions are folded into bounds: portable to the interpreter)
    cache_dtype = k_cache_ptr.dtype.element_ty

    key = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dm, other=0.0)
    val = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dm, other=0.0)
    if FP8:
        # the reference's scale (a product, see INV_FP8_MAX) and IEEE divisions (`/` is approximate on GPUs)
        key_scale = tl.max(tl.abs(key.to(tl.float32)), axis=0) * _INV_FP8_MAX
        val_scale = tl.max(tl.abs(val.to(tl.float32)), axis=0) * _INV_FP8_MAX
        key = _e4m3_grid(tl.math.div_rn(key.to(tl.float32), tl.where(key_scale > 0, key_scale, 1.0)))
        val = _e4m3_grid(tl.math.div_rn(val.to(tl.float32), tl.where(val_scale > 0, val_scale, 1.0)))
        scale_at = blk * stride_sb + h * stride_sh + off
        tl.store(k_scale_ptr + scale_at, key_scale, mask=live)
        tl.store(v_scale_ptr + scale_at, val_scale, mask=live)
    key = key.to(cache_dtype)
    val = val.to(v_cache_ptr.dtype.element_ty)
    block_base = blk * stride_cb + h * stride_ch
    tl.store(k_cache_ptr + block_base + off * stride_ct + d, key, mask=dm)
    tl.store(v_cache_ptr + block_base + off * stride_ct + d, val, mask=dm)

    if MODE != 0:
        nxt = tl.load(slot_ptr + t + 1, mask=t + 1 < num_tokens, other=-1).to(tl.int64)
        if MODE == 1 or MODE == 3:
            act = live & (off == BS - 1)
        else:
            act = live & ((nxt != slot + 1) | (off == BS - 1))
        if act:
            j = tl.arange(0, BS).to(tl.int64)
            src = t - (off - j)  # where offset j sits in this call's inputs if it was written now
            upto = j <= off
            src_slot = tl.load(slot_ptr + src, mask=upto & (src >= 0), other=-1).to(tl.int64)
            from_input = upto & (src >= 0) & (src_slot == blk * BS + j)
            from_cache = upto & (~from_input)
            m_in = from_input[:, None] & (d[None, :] < D)
            m_cache = from_cache[:, None] & (d[None, :] < D)
            k_in = tl.load(k_ptr + src[:, None] * stride_kt + h * stride_kh + d[None, :], mask=m_in, other=0.0)
            k_old = tl.load(k_cache_ptr + block_base + j[:, None] * stride_ct + d[None, :], mask=m_cache, other=0.0)
            if FP8:  # the keys as stored: this call's rounded through e4m3, the cache's dequantized
                k_in = k_in.to(tl.float32)
                in_scale = tl.max(tl.abs(k_in), axis=1) * _INV_FP8_MAX
                in_safe = tl.where(in_scale > 0, in_scale, 1.0)
                k_in = _e4m3_grid(tl.math.div_rn(k_in, in_safe[:, None])) * in_scale[:, None]
                old_scale = tl.load(k_scale_ptr + blk * stride_sb + h * stride_sh + j, mask=from_cache, other=0.0)
                keys = tl.where(from_input[:, None], k_in, k_old.to(tl.float32) * old_scale[:, None])
            else:
                keys = tl.where(from_input[:, None], k_in.to(cache_dtype), k_old).to(tl.float32)
            lm_dtype = lm_ptr.dtype.element_ty
            if MODE == 1:
                mean = tl.sum(keys, axis=0) / BS
                tl.store(lm_ptr + (blk * H + h) * D + d, mean.to(lm_dtype), mask=d < D)
            elif MODE == 3:
                mean = tl.where(d < D, tl.sum(keys, axis=0) / BS, 0.0)
                scale = tl.max(tl.abs(mean), axis=0) * _INV_INT8_MAX
                y = tl.math.div_rn(mean, tl.where(scale > 0, scale, 1.0))
                y = tl.minimum(tl.maximum((y + _ROUND_MAGIC) - _ROUND_MAGIC, -_INT8_MAX), _INT8_MAX)
                at = (blk * H + h) * LM_W  # the landmark row's first byte
                tl.store(lm_ptr + at + d, y.to(tl.int8), mask=d < D)
                tl.store(lm_scale_ptr + at // 4 + D // 4, scale)
            else:
                kmax = tl.max(tl.where(upto[:, None], keys, float("-inf")), axis=0)
                kmin = tl.min(tl.where(upto[:, None], keys, float("inf")), axis=0)
                base = (blk * H + h) * (2 * D)
                tl.store(lm_ptr + base + d, kmax.to(lm_dtype), mask=d < D)
                tl.store(lm_ptr + base + D + d, kmin.to(lm_dtype), mask=d < D)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    landmarks: torch.Tensor | None,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mode: str = "mean",
    kv_scales: KVScales | None = None,
) -> None:
    """Store `k, v: [T, H_kv, D]` at `slots: [T]`; refresh landmarks (None: dense layer, no landmarks). `kv_scales`:
    the caches are FP8 pages."""
    num_tokens, num_heads, head_dim = k.shape
    _, cache_heads, block_size, cache_dim = k_cache.shape
    if (num_heads, head_dim) != (cache_heads, cache_dim) or v.shape != k.shape:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache {tuple(k_cache.shape)}")
    strides = cache_strides(k_cache, v_cache)
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous last (head_dim) dimension")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size={block_size}: the Triton kernels need a power of two")
    mode_id = MODE_NONE
    lm = lm_scale = k_cache  # placeholder pointers, never dereferenced without landmarks
    if landmarks is not None:
        width = SparseAttentionConfig(landmark=mode).landmark_width(head_dim)  # refuses an unknown mode by name
        mode_id = _MODE_IDS[mode]
        if landmarks.shape != (k_cache.shape[0], cache_heads, width) or not landmarks.is_contiguous():
            raise ValueError(
                f"landmarks {tuple(landmarks.shape)}: expected a contiguous [{k_cache.shape[0]}, {cache_heads}, {width}] "
                f"for mode {mode!r}"
            )
        check_landmark_dtype(landmarks, mode)
        lm = lm_scale = landmarks
        if mode_id == MODE_MEAN_INT8:
            lm_scale = landmarks.view(torch.float32)  # the float32 scale after each row's D int8 values
    scale_offsets = scale_strides(kv_scales, k_cache)
    if num_tokens == 0:
        return
    fp8 = kv_scales is not None
    k_scale, v_scale = (kv_scales.k, kv_scales.v) if fp8 else (slots, slots)  # placeholders, never dereferenced
    _write_kv_kernel[(num_tokens, num_heads)](
        k, v, slots, k_cache, v_cache, k_scale, v_scale, lm, lm_scale,
        num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *strides, *scale_offsets,
        H=num_heads, D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BS=block_size, MODE=mode_id, FP8=fp8,
        LM_W=0 if landmarks is None else landmarks.shape[-1],
        num_warps=1 if mode_id == MODE_NONE else 2,
    )
