"""One block-sparse decode attention step: score → select → attend (the whole-step reference)."""

import torch

from sparrow.layout import SparseAttentionConfig

from .attention import paged_decode_attention
from .kv_quant import KVScales
from .scoring import score_paged_blocks
from .selection import select_blocks


def block_sparse_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    landmarks: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    budgets: torch.Tensor,
    config: SparseAttentionConfig,
    scale: float | None = None,
    kv_scales: KVScales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention where each sequence attends to at most `budgets[b]` blocks per KV head.

    Rows whose context fits their budget are exact dense attention. Returns the output `[B, H_q, D]`
    and the number of blocks attended per sequence `[B]`.
    """
    block_size = k_cache.shape[2]
    num_blocks = (seq_lens.long() + block_size - 1) // block_size
    scores = score_paged_blocks(q, landmarks, block_tables, num_blocks, config.landmark)
    block_ids, counts = select_blocks(scores, num_blocks, budgets, config.sink, config.recent)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, block_ids, scale, kv_scales)
    return out, counts
