"""FP8 (e4m3) KV pages: each stored key and value vector (one token, one KV head) with its own float32 scale.

A scale per vector needs no calibration pass and no model-specific range: the vector's largest element maps to
e4m3's largest finite value (448), so nothing overflows, and rounding moves each element by at most 2^-4 of its
magnitude. The scales add 4 bytes per stored vector (3 % of a 128-dim fp8 vector): pages and scales take 0.52 of
bfloat16's bytes per token (0.53 with the landmarks, at Qwen3-1.7B's shape), so one GPU holds ~1.9x the sequences.
"""

from dataclasses import dataclass

import torch

from sparrow.layout import KV_CACHE_DTYPES

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
INV_FP8_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))
"""A scale is `amax * INV_FP8_MAX` (float32-exact), not `amax / FP8_MAX`: torch on CUDA divides by a Python scalar
as a multiplication by its reciprocal, on the CPU it divides, so only the product is the same number everywhere
(this reference, the torch backend on either device, the Triton kernel)."""


@dataclass(frozen=True)
class KVScales:
    """The scales of one layer's FP8 pages, `[num_blocks, H_kv, block_size]` float32 each."""

    k: torch.Tensor
    v: torch.Tensor


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x: [..., D]` → (e4m3 `[..., D]`, float32 scales `[...]`); an all-zero vector gets scale 0."""
    amax = x.float().abs().amax(dim=-1)
    scale = amax * INV_FP8_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x.float() / safe[..., None]).to(FP8_KV_DTYPE), scale


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 `[..., D]` and its scales `[...]` → `dtype` (float32 or wider for attention's accumulation)."""
    return (x.float() * scale[..., None]).to(dtype)


def read_pages(cache: torch.Tensor, scale: torch.Tensor | None, index, dtype: torch.dtype) -> torch.Tensor:
    """`cache[index]` as attention reads it, in `dtype`; FP8 pages (`scale` given) dequantized with `scale[index]`."""
    pages = cache[index]
    return pages.to(dtype) if scale is None else dequantize(pages, scale[index], dtype)


def round_trip(x: torch.Tensor) -> torch.Tensor:
    """What attention reads back after `x` was stored in FP8 pages (the teacher-forced replay of an FP8 rollout)."""
    return dequantize(*quantize(x), x.dtype)


def page_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype K/V pages are stored in: the model's (`auto`) or e4m3."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r}: use one of {KV_CACHE_DTYPES}")
    return dtype if kv_cache_dtype == "auto" else FP8_KV_DTYPE


def vector_bytes(head_dim: int, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """Bytes of one stored key or value vector (one token, one KV head): FP8 pages add its float32 scale."""
    return head_dim * page_dtype(kv_cache_dtype, dtype).itemsize + (0 if kv_cache_dtype == "auto" else 4)
