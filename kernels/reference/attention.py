"""Paged decode attention over a list of blocks per (sequence, KV head), and its dense special case."""

import torch

from .kv_quant import KVScales, read_pages


def dense_block_ids(num_blocks: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """All blocks of every sequence, `[B, H_kv, max n]`, padded with -1."""
    width = int(num_blocks.max()) if num_blocks.numel() else 0
    pos = torch.arange(width, device=num_blocks.device)
    ids = torch.where(pos[None, :] < num_blocks[:, None], pos[None, :], -1)
    return ids[:, None, :].expand(-1, num_kv_heads, -1)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_ids: torch.Tensor | None = None,
    scale: float | None = None,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:
    """One query token per sequence attends to the tokens of its listed blocks.

    `q: [B, H_q, D]`; caches `[num_physical_blocks, H_kv, block_size, D]`; `block_tables: [B, M]`
    logical → physical; `seq_lens: [B]` tokens in the cache, the current one included;
    `block_ids: [B, H_kv, K]` logical blocks per row, -1 padded (None = all blocks, i.e. dense).
    Tokens at positions ≥ seq_len are masked. Softmax and products run in float32 or wider. `kv_scales`:
    the caches are FP8 pages, dequantized as they are read.
    Returns `[B, H_q, D]` in q's dtype.
    """
    bsz, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    seq_lens = seq_lens.long()
    if block_ids is None:
        block_ids = dense_block_ids((seq_lens + block_size - 1) // block_size, num_kv_heads)
    acc = torch.promote_types(q.dtype, torch.float32)
    scale = head_dim**-0.5 if scale is None else scale

    valid_block = block_ids >= 0
    logical = block_ids.clamp(min=0)
    physical = torch.gather(block_tables.long(), 1, logical.flatten(1)).view_as(logical)
    heads = torch.arange(num_kv_heads, device=q.device)[None, :, None]
    k_scale, v_scale = (None, None) if kv_scales is None else (kv_scales.k, kv_scales.v)
    keys = read_pages(k_cache, k_scale, (physical, heads), acc)  # [B, H_kv, K, bs, D]
    values = read_pages(v_cache, v_scale, (physical, heads), acc)
    tokens = logical[..., None] * block_size + torch.arange(block_size, device=q.device)
    valid = valid_block[..., None] & (tokens < seq_lens[:, None, None, None])

    keys = keys.flatten(2, 3)  # [B, H_kv, K*bs, D]
    values = values.flatten(2, 3)
    qg = q.to(acc).view(bsz, num_kv_heads, group, head_dim)
    logits = torch.einsum("bhgd,bhtd->bhgt", qg, keys) * scale
    logits = logits.masked_fill(~valid.flatten(2)[:, :, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhgt,bhtd->bhgd", probs, values)
    return out.reshape(bsz, num_q_heads, head_dim).to(q.dtype)
