"""KV-cache write fused with landmark maintenance (decode append and prefill write, one kernel).

One program per (token, KV head) stores the token's key and value into its slot of the HND paged cache.
The program whose token is the last one this call writes into a block also refreshes that block's
landmark: the mean key once the block is full (mode 1), or the channel-wise max ‖ min of the keys
written so far (mode 2). The block's keys come from this call's inputs where they were written in this
call and from the cache otherwise, so no program waits for another program's stores.

Contract (true for decode, prefill and chunked prefill): tokens written into the same block by one call
are consecutive in `slots`, in increasing offset order. Slots < 0 are skipped (CUDA-graph padding).
"""

import torch
import triton
import triton.language as tl

from .attention import cache_strides

MODE_NONE, MODE_MEAN, MODE_MINMAX = 0, 1, 2


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, lm_ptr,
    num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ch, stride_ct,
    H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr, MODE: tl.constexpr,
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

    key = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=dm, other=0.0).to(cache_dtype)
    val = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=dm, other=0.0).to(v_cache_ptr.dtype.element_ty)
    block_base = blk * stride_cb + h * stride_ch
    tl.store(k_cache_ptr + block_base + off * stride_ct + d, key, mask=dm)
    tl.store(v_cache_ptr + block_base + off * stride_ct + d, val, mask=dm)

    if MODE != 0:
        nxt = tl.load(slot_ptr + t + 1, mask=t + 1 < num_tokens, other=-1).to(tl.int64)
        if MODE == 1:
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
            keys = tl.where(from_input[:, None], k_in.to(cache_dtype), k_old).to(tl.float32)
            lm_dtype = lm_ptr.dtype.element_ty
            if MODE == 1:
                mean = tl.sum(keys, axis=0) / BS
                tl.store(lm_ptr + (blk * H + h) * D + d, mean.to(lm_dtype), mask=d < D)
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
) -> None:
    """Store `k, v: [T, H_kv, D]` at `slots: [T]`; refresh landmarks (None: dense layer, no landmarks)."""
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
    lm = k_cache  # placeholder pointer, never dereferenced without landmarks
    if landmarks is not None:
        mode_id = {"mean": MODE_MEAN, "minmax": MODE_MINMAX}.get(mode)
        if mode_id is None:
            raise ValueError(f"landmark mode {mode!r}: use 'mean' or 'minmax'")
        width = head_dim if mode == "mean" else 2 * head_dim
        if landmarks.shape != (k_cache.shape[0], cache_heads, width) or not landmarks.is_contiguous():
            raise ValueError(
                f"landmarks {tuple(landmarks.shape)}: expected a contiguous [{k_cache.shape[0]}, {cache_heads}, {width}] "
                f"for mode {mode!r}"
            )
        lm = landmarks
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_heads)](
        k, v, slots, k_cache, v_cache, lm,
        num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *strides,
        H=num_heads, D=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BS=block_size, MODE=mode_id,
        num_warps=1 if mode_id == MODE_NONE else 2,
    )
