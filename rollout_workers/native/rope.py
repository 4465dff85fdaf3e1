"""Rotary position embeddings for the RoPE variants of Llama / Qwen configs.

Frequencies follow transformers' definitions (default, linear, llama3, yarn) so logits match an HF
forward; cos/sin tables are built once in float32 for every position up to the maximum length.
"""

import math

import torch


def inverse_frequencies(params: dict, head_dim: int) -> tuple[torch.Tensor, float]:
    """`(inv_freq [head_dim/2], attention_scaling)` for a `rope_parameters` dict."""
    base = float(params["rope_theta"])
    kind = params["rope_type"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "default":
        return inv_freq, 1.0
    if kind == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv_freq, params), 1.0
    if kind == "yarn":
        return _yarn(base, head_dim, params)
    raise ValueError(f"rope_type={kind!r}: supported are default, linear, llama3, yarn")


def _llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor, low, high = float(params["factor"]), float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


def _yarn(base: float, dim: int, params: dict) -> tuple[torch.Tensor, float]:
    factor = float(params["factor"])
    old_len = float(params["original_max_position_embeddings"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(params.get("beta_fast") or 32), correction_dim(params.get("beta_slow") or 1)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables; `forward(positions, dtype)` gathers them once per model forward for all layers."""

    def __init__(self, params: dict, head_dim: int, max_positions: int, device=None):
        super().__init__()
        inv_freq, scaling = inverse_frequencies(params, head_dim)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(device), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(device), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """RoPE in the rotate-half convention on `q: [N, H, D]`, `k: [N, H_kv, D]` with `cos, sin: [N, 1, D]`."""
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
