"""`TorchBackend`: the reference decode semantics with gathers and batched matmuls that are fast on CPU.

The reference gathers a `[B, H_kv, K, 16, D]` block of K/V through two advanced indices and contracts
it with einsum; here each (block, KV head) page is one contiguous `[16, D]` row of the cache seen as
`[num_blocks · H_kv, 16, D]`, so a single `index_select` lands K/V directly in `[B, H_kv, K·16, D]`
order and attention is two batched matmuls. Block scores and the top-k rule are the reference's own
functions, so selection is identical by construction; outputs match the reference to float rounding
(tests/test_engine_backend.py).
"""

import torch

from sparrow.layout import SparseAttentionConfig

from .backend import AttentionBackend
from .reference import (
    KVScales,
    dequantize,
    encode_mean,
    mean_keys,
    score_paged_blocks,
    select_blocks,
    store_pages,
    update_landmarks,
)


class TorchBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, k_cache, v_cache, landmarks, slots, k, v, config: SparseAttentionConfig,
                 kv_scales: KVScales | None = None) -> None:
        bs = k_cache.shape[2]
        slots = slots.long()
        live = slots >= 0  # padding rows of a static decode batch carry slot -1, as for the Triton write
        if not bool(live.all()):
            slots, k, v = slots[live], k[live], v[live]
        blocks, offsets = slots // bs, slots % bs
        store_pages(k_cache, v_cache, blocks, offsets, k, v, kv_scales)
        if landmarks is None:
            return
        k_scale = None if kv_scales is None else kv_scales.k
        if config.landmark == "minmax":
            update_landmarks(k_cache, landmarks, blocks, offsets, config.landmark, k_scale)
            return
        # A mean landmark changes only when its block's last slot is written (slots are distinct).
        full = blocks[offsets == bs - 1]
        landmarks[full] = encode_mean(mean_keys(k_cache, k_scale, full), config.landmark, landmarks.dtype)

    def decode(self, q, k_cache, v_cache, landmarks, block_tables, seq_lens, budgets, config, scale, kv_scales=None):
        bs = k_cache.shape[2]
        seq_lens = seq_lens.long()
        num_blocks = (seq_lens + bs - 1) // bs
        tables = block_tables.long()
        if budgets is None:
            width = tables.shape[1]
            logical = torch.arange(width, device=q.device).expand(tables.shape[0], k_cache.shape[1], width)
            counts = num_blocks
        else:
            scores = score_paged_blocks(q, landmarks, tables, num_blocks, config.landmark)
            logical, counts = select_blocks(scores, num_blocks, budgets, config.sink, config.recent)
        return paged_attention(q, k_cache, v_cache, tables, seq_lens, logical, scale, kv_scales), counts


def paged_attention(q, k_cache, v_cache, tables, seq_lens, logical, scale: float,
                    kv_scales: KVScales | None = None) -> torch.Tensor:
    """`q: [B, H_q, D]` over the logical blocks `logical: [B, H_kv, K]` (-1 = padding) of each row (`kv_scales`:
    FP8 pages, dequantized after the gather)."""
    bsz, num_q_heads, head_dim = q.shape
    num_blocks_total, num_kv_heads, bs, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    width = logical.shape[-1]
    physical = torch.gather(tables, 1, logical.clamp(min=0).flatten(1)).view_as(logical)
    pages = (physical * num_kv_heads + torch.arange(num_kv_heads, device=q.device)[None, :, None]).flatten()
    acc = torch.promote_types(q.dtype, torch.float32)
    keys = k_cache.view(num_blocks_total * num_kv_heads, bs, head_dim).index_select(0, pages)
    values = v_cache.view(num_blocks_total * num_kv_heads, bs, head_dim).index_select(0, pages)
    if kv_scales is not None:
        keys = dequantize(keys, kv_scales.k.view(num_blocks_total * num_kv_heads, bs).index_select(0, pages), acc)
        values = dequantize(values, kv_scales.v.view(num_blocks_total * num_kv_heads, bs).index_select(0, pages), acc)
    keys = keys.view(bsz, num_kv_heads, width * bs, head_dim).to(acc)
    values = values.view(bsz, num_kv_heads, width * bs, head_dim).to(acc)
    tokens = (logical[..., None] * bs + torch.arange(bs, device=q.device)).flatten(2)  # [B, H_kv, K·bs]
    valid = (logical >= 0).repeat_interleave(bs, dim=-1) & (tokens < seq_lens[:, None, None])
    qg = q.to(acc).view(bsz, num_kv_heads, group, head_dim)
    logits = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [B, H_kv, G, K·bs]
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(logits, dim=-1), values)
    return out.reshape(bsz, num_q_heads, head_dim).to(q.dtype)
