"""Paged KV-cache writes with landmark maintenance (reference semantics).

Layout (HND pages): `k_cache, v_cache: [num_blocks, H_kv, block_size, D]`; landmarks
`[num_blocks, H_kv, W]` with W = D (mean key) or 2·D (channel-wise max ‖ min, Quest). A token's
slot is `physical_block * block_size + offset`. Tokens of a sequence are written in order, so the
highest offset written into a block tells how many of its slots are valid.

Mean landmarks are written only when a block fills (the written token has offset block_size-1),
from the block's stored keys accumulated in float32 or wider, as Sparrow does. Min/max landmarks are
exact for any prefix of the block, so they are kept current on every write.

An FP8 cache (`KVScales` given) stores each key and value quantized with its own scale; landmarks stay in
the model's dtype and are computed from the keys as stored (dequantized), which is what attention reads.

`mean_int8` landmarks are the float32 mean key rounded to int8 with one float32 scale per (block, KV head), the
largest element mapped to 127 (`encode_mean`), stored as D int8 values, the scale's 4 bytes and zero padding
(`sparrow.layout.INT8_ROW_ALIGN`): one tensor of int8 rows, so every kernel signature stays the same. Scores read
them back with `decode_landmarks`.
"""

import torch

from sparrow.layout import SparseAttentionConfig

from .kv_quant import KVScales, quantize, read_pages

INT8_MAX = 127
INV_INT8_MAX = float(torch.tensor(1.0 / INT8_MAX, dtype=torch.float32))
"""A scale is `amax * INV_INT8_MAX` (float32-exact), the same number on every device and in the Triton kernel (see
`kv_quant.INV_FP8_MAX`)."""


def landmark_dtype(mode: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype landmarks of `mode` are stored in, for activations of `dtype`."""
    return torch.int8 if mode == "mean_int8" else dtype


def check_landmark_dtype(landmarks: torch.Tensor, mode: str) -> None:
    """Refuse landmarks whose dtype does not fit `mode`: `mean_int8` rows, and only they, are int8."""
    if (mode == "mean_int8") != (landmarks.dtype == torch.int8):
        raise ValueError(f"landmarks of dtype {landmarks.dtype} for landmark={mode!r}: mean_int8 landmarks, and only "
                         "they, are int8 (sparrow.kernels.reference.landmark_dtype)")


def encode_mean(mean: torch.Tensor, mode: str, dtype: torch.dtype) -> torch.Tensor:
    """Mean keys `[..., D]` (float32 or wider) as landmarks of `mode` stored in `dtype` (`landmark_dtype`)."""
    if mode != "mean_int8":
        return mean.to(dtype)
    mean = mean.float()
    head_dim = mean.shape[-1]
    scale = mean.abs().amax(dim=-1, keepdim=True) * INV_INT8_MAX
    values = torch.round(mean / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp(-INT8_MAX, INT8_MAX)
    pad = SparseAttentionConfig(landmark=mode).landmark_width(head_dim) - head_dim - 4
    padding = torch.zeros(*mean.shape[:-1], pad, dtype=torch.int8, device=mean.device)
    return torch.cat([values.to(torch.int8), scale.view(torch.int8), padding], dim=-1)


def mean_keys(k_cache: torch.Tensor, k_scale: torch.Tensor | None, blocks: torch.Tensor) -> torch.Tensor:
    """The mean of each of `blocks`' stored keys `[n, H_kv, D]`, accumulated in float32 or wider (FP8 pages dequantized)."""
    acc = torch.promote_types(k_cache.dtype if k_scale is None else torch.float32, torch.float32)
    return read_pages(k_cache, k_scale, blocks, acc).mean(dim=2)


def decode_landmarks(landmarks: torch.Tensor, mode: str, head_dim: int) -> torch.Tensor:
    """Stored landmarks as the scores read them: `mean_int8` rows dequantized to float32 `[..., head_dim]`, others as
    they are."""
    if mode != "mean_int8":
        return landmarks
    scale = landmarks[..., head_dim : head_dim + 4].contiguous().view(torch.float32)
    return landmarks[..., :head_dim].float() * scale


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
    """Store `k, v: [T, H_kv, D]` at `slots: [T]` and refresh the landmarks of the touched blocks."""
    block_size = k_cache.shape[2]
    slots = slots.long()
    blocks, offsets = slots // block_size, slots % block_size
    store_pages(k_cache, v_cache, blocks, offsets, k, v, kv_scales)
    if landmarks is not None:
        update_landmarks(k_cache, landmarks, blocks, offsets, mode, None if kv_scales is None else kv_scales.k)


def store_pages(k_cache, v_cache, blocks, offsets, k, v, kv_scales: KVScales | None) -> None:
    """Put `k, v: [T, H_kv, D]` at (blocks, offsets): cast to the cache's dtype, or quantized with their scales."""
    if kv_scales is None:
        k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
        v_cache[blocks, :, offsets] = v.to(v_cache.dtype)
    else:
        k_cache[blocks, :, offsets], kv_scales.k[blocks, :, offsets] = quantize(k)
        v_cache[blocks, :, offsets], kv_scales.v[blocks, :, offsets] = quantize(v)


def update_landmarks(
    k_cache: torch.Tensor,
    landmarks: torch.Tensor,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    mode: str,
    k_scale: torch.Tensor | None = None,
) -> None:
    """Recompute the landmark of every block touched by a write at (blocks, offsets) (`k_scale`: an FP8 cache's)."""
    block_size = k_cache.shape[2]
    touched, inverse = torch.unique(blocks, return_inverse=True)
    last = torch.full_like(touched, -1).scatter_reduce(0, inverse, offsets, "amax")
    if mode in ("mean", "mean_int8"):
        full = touched[last == block_size - 1]
        if full.numel():
            landmarks[full] = encode_mean(mean_keys(k_cache, k_scale, full), mode, landmarks.dtype)
        return
    if mode != "minmax":
        raise ValueError(f"landmark mode {mode!r}: use 'mean', 'minmax' or 'mean_int8'")
    keys = read_pages(k_cache, k_scale, touched, landmarks.dtype)  # [n, H, bs, D]
    valid = (torch.arange(block_size, device=keys.device)[None, :] <= last[:, None])[:, None, :, None]
    kmax = keys.masked_fill(~valid, float("-inf")).amax(dim=2)
    kmin = keys.masked_fill(~valid, float("inf")).amin(dim=2)
    landmarks[touched] = torch.cat([kmax, kmin], dim=-1).to(landmarks.dtype)


def landmarks_from_keys(keys: torch.Tensor, block_size: int, mode: str = "mean") -> torch.Tensor:
    """Landmarks of the full blocks of a contiguous key sequence `keys: [..., T, H_kv, D]` (leading dims: a batch).

    Returns `[..., T // block_size, H_kv, W]`; used by the teacher-forced (trainer) path, and as the
    from-scratch recomputation the paged writes are tested against.
    """
    *lead, seq_len, heads, dim = keys.shape
    n_full = seq_len // block_size
    blocks = keys[..., : n_full * block_size, :, :].reshape(*lead, n_full, block_size, heads, dim)
    if mode in ("mean", "mean_int8"):
        acc = torch.promote_types(keys.dtype, torch.float32)
        return encode_mean(blocks.to(acc).mean(dim=-3), mode, landmark_dtype(mode, keys.dtype))
    return torch.cat([blocks.amax(dim=-3), blocks.amin(dim=-3)], dim=-1)
