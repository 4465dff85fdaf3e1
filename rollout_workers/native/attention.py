"""The three ways the model's attention runs: paged prefill, paged decode, teacher-forced.

All three implement one rule (`sparrow.kernels.reference`): a query at position i has context
L = i + 1; it attends densely in dense layers, at prompt positions and when its ceil(L/16) blocks
fit its budget; otherwise to its sink blocks, its recent blocks and the top-scoring full blocks by
landmark, chosen per KV head.
"""

from dataclasses import dataclass

import torch

from sparrow.kernels import AttentionBackend, SparseAttentionConfig
from sparrow.kernels.reference import (
    SparseRows,
    block_sparse_causal_sdpa,
    causal_rows_mask,
    read_pages,
    round_trip,
    sdpa,
    sparse_rows_mask,
)

from .kv_cache import KVCache


def blocks_attended(num_tokens: torch.Tensor, budgets: torch.Tensor | None, config: SparseAttentionConfig) -> torch.Tensor:
    """Blocks per KV head a query with context `num_tokens` attends to under `budgets` (None = dense)."""
    blocks = (num_tokens + config.block_size - 1) // config.block_size
    if budgets is None:
        return blocks
    return torch.minimum(blocks, budgets.clamp(min=config.reserved_blocks))


@dataclass
class PrefillChunkMeta:
    rows: slice
    """This chunk's rows in the flat batch."""
    start: int
    end: int
    block_table: torch.Tensor
    """Physical blocks holding positions [0, end)."""
    positions: torch.Tensor
    budgets: torch.Tensor | None
    """Per-row budgets when some row is sparse (recompute of decoded positions), else None."""


class PagedPrefill:
    """Writes the chunk's K/V into the cache, then attends: a chunk starting at 0 with dense rows
    uses its own K/V under a causal mask; others read their context back from the cache. With FP8 pages every
    query reads K/V as stored (the first chunk its own K/V rounded through e4m3), as decode does."""

    def __init__(self, cache: KVCache, backend: AttentionBackend, config: SparseAttentionConfig,
                 slots: torch.Tensor, chunks: list[PrefillChunkMeta]):
        self.cache, self.backend, self.config = cache, backend, config
        self.slots, self.chunks = slots, chunks

    def __call__(self, layer: int, q, k, v):
        k_cache, v_cache, landmarks = self.cache.layer(layer)
        kv_scales = self.cache.scales(layer)
        self.backend.write_kv(k_cache, v_cache, landmarks, self.slots, k, v, self.config, kv_scales)
        sparse_layer = not self.config.is_dense_layer(layer)
        out = torch.empty_like(q)
        for c in self.chunks:
            qc = q[c.rows]
            budgets = c.budgets if sparse_layer else None
            if c.start == 0 and budgets is None:
                kc, vc = (k[c.rows], v[c.rows]) if kv_scales is None else (round_trip(k[c.rows]), round_trip(v[c.rows]))
                out[c.rows] = sdpa(qc, kc, vc, causal=True)
                continue
            k_scale, v_scale = (None, None) if kv_scales is None else (kv_scales.k, kv_scales.v)
            keys = read_pages(k_cache, k_scale, c.block_table, q.dtype).transpose(1, 2).flatten(0, 1)[: c.end]
            values = read_pages(v_cache, v_scale, c.block_table, q.dtype).transpose(1, 2).flatten(0, 1)[: c.end]
            if budgets is None:
                mask = causal_rows_mask(c.positions, c.end)[None]
            else:
                mask = sparse_rows_mask(qc, keys, c.positions, budgets, self.config)
            out[c.rows] = sdpa(qc, keys, values, mask)
        return out


class PagedDecode:
    """One new token per sequence: write its K/V, then let the backend attend (sparse layers get the
    budgets). `blocks_attended` holds the first sparse layer's per-sequence block counts."""

    def __init__(self, cache: KVCache, backend: AttentionBackend, config: SparseAttentionConfig, slots, block_tables,
                 seq_lens, budgets: torch.Tensor | None, scale: float):
        self.cache, self.backend, self.config = cache, backend, config
        self.slots, self.block_tables, self.seq_lens, self.budgets, self.scale = slots, block_tables, seq_lens, budgets, scale
        self.blocks_attended: torch.Tensor | None = None

    def __call__(self, layer: int, q, k, v):
        k_cache, v_cache, landmarks = self.cache.layer(layer)
        kv_scales = self.cache.scales(layer)
        self.backend.write_kv(k_cache, v_cache, landmarks, self.slots, k, v, self.config, kv_scales)
        sparse = landmarks is not None and self.budgets is not None
        out, counts = self.backend.decode(
            q, k_cache, v_cache, landmarks if sparse else None, self.block_tables, self.seq_lens,
            self.budgets if sparse else None, self.config, self.scale, kv_scales,
        )
        if sparse and self.blocks_attended is None:
            self.blocks_attended = counts
        return out


class TeacherForced:
    """Whole sequences without a cache: in sparse layers `block_sparse_causal_sdpa` (the reference rule, the masked
    softmax done by SDPA: 2x faster on CPU); causal dense attention elsewhere."""

    def __init__(self, config: SparseAttentionConfig, budgets: torch.Tensor | None, device: torch.device | str = "cpu"):
        """`budgets: [T]` per query (host or device; None = dense), moved to `device` with the sequence's sparse
        rows once, not in every layer."""
        self.config, self.budgets, self.rows = config, None, None
        if budgets is not None:
            self.budgets = budgets.to(device)
            self.rows = SparseRows.of(budgets[None], [budgets.shape[0]], config, device)

    def __call__(self, layer: int, q, k, v):
        if self.budgets is None or self.config.is_dense_layer(layer):
            return sdpa(q, k, v, causal=True)
        return block_sparse_causal_sdpa(q, k, v, self.budgets, self.config, rows=self.rows)
