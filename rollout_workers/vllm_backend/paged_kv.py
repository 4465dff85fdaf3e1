"""How the sparse layers store K and V inside vLLM's KV pages, and dense prefill over them.

vLLM allocates every attention layer `num_pages` pages of `page_size = 16·m` tokens and leaves the
meaning of a page's bytes to the layer's backend. A sparse layer stores one page as `[m, 2, H_kv, 16,
D]`: m Sparrow blocks, each a K block then a V block in the reference HND layout. Then

- Sparrow block `page·m + j` has its K and V at fixed strides, so the whole cache is two zero-copy
  `[num_pages·m, H_kv, 16, D]` views that `sparrow.kernels` backends read and write directly;
- a vLLM slot `page·16m + offset` is also the Sparrow slot of that token (block·16 + offset);
- each page stays self-contained, so vLLM may zero, copy, share (prefix caching) or reuse pages.

On CPU the dense layers' `CPU_ATTN` forces pages of 32 tokens (m = 2); on CUDA pages are 16 tokens.
"""

import torch

from sparrow.kernels.reference import causal_rows_mask, read_pages, sdpa
from sparrow.layout import BLOCK_SIZE


def _page_memory(kv_cache: torch.Tensor) -> torch.Tensor:
    """`[num_pages, page_elems]` view of each page's memory, whatever logical order vLLM chose."""
    inner = sorted((1, 2, 3), key=lambda d: -kv_cache.stride(d))
    pages = kv_cache.permute(0, *inner)
    try:
        return pages.view(pages.shape[0], -1)
    except RuntimeError:
        raise ValueError(
            f"KV page of shape {tuple(kv_cache.shape)} and strides {kv_cache.stride()} is not contiguous "
            "inside a page; the sparse layers need block-compact pages"
        ) from None


def sparse_block_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every Sparrow block: two views `[num_pages·m, H_kv, 16, D]` into `kv_cache`.

    `kv_cache` is vLLM's logical `[num_pages, H_kv, page_size, 2·D]` tensor of one layer.
    """
    num_pages, num_kv_heads, page_size, two_d = kv_cache.shape
    if page_size % BLOCK_SIZE:
        raise ValueError(f"vLLM block_size={page_size}: the sparse layers need a multiple of {BLOCK_SIZE}")
    per_page = page_size // BLOCK_SIZE
    head_dim = two_d // 2
    blocks = _page_memory(kv_cache).view(num_pages, per_page, 2, num_kv_heads, BLOCK_SIZE, head_dim)
    shape = (num_pages * per_page, num_kv_heads, BLOCK_SIZE, head_dim)
    try:
        return blocks[:, :, 0].view(shape), blocks[:, :, 1].view(shape)
    except RuntimeError:
        raise ValueError(
            f"vLLM block_size={page_size} packs {per_page} Sparrow blocks per page, which needs the layer's pages "
            f"to be contiguous (layer-outermost KV layout); use block_size={BLOCK_SIZE} or an LBHNC/LBNHC layout"
        ) from None


def sparse_block_table(block_table: torch.Tensor, page_size: int) -> torch.Tensor:
    """vLLM's page table `[B, P]` → Sparrow's block table `[B, P·m]` (block = page·m + j)."""
    per_page = page_size // BLOCK_SIZE
    if per_page == 1:
        return block_table
    offsets = torch.arange(per_page, device=block_table.device, dtype=block_table.dtype)
    return (block_table[:, :, None] * per_page + offsets).flatten(1)


def paged_prefill_attention(
    query: torch.Tensor,
    k_blocks: torch.Tensor,
    v_blocks: torch.Tensor,
    block_table: torch.Tensor,
    query_spans: list[tuple[int, int]],
    seq_lens: list[int],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Dense causal attention for prefill rows whose keys are already in the paged cache.

    Row r's queries `query[start:end]` (`query_spans[r]`) are the last positions of its `seq_lens[r]` tokens
    (chunked prefill and prefix-cache hits read earlier pages); `block_table[r]` holds its blocks. Writes the same
    rows of `out` (`[num_tokens, H_q, D]`). Keys are gathered per row (O(context) copy, like any paged read), then
    one `sdpa` call as the native engine's paged prefill makes it: causal alone (a flash kernel) when the row's
    queries are its whole context, else with a bottom-right causal mask and K/V repeated to the query heads (the
    memory-efficient kernel; a mask with `enable_gqa` sent a GPU to the math kernel, which holds every query's
    logits over the whole context: on an H100 this prefill read 7.7x slower than the native engine's at 25K tokens).
    """
    num_kv_heads, head_dim = k_blocks.shape[1], k_blocks.shape[3]
    for row, ((start, end), seq_len) in enumerate(zip(query_spans, seq_lens)):
        num_queries = end - start
        if num_queries == 0:
            continue
        ids = block_table[row, : (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE].long()
        q = query[start:end]
        keys = read_pages(k_blocks, None, ids, q.dtype).transpose(1, 2).reshape(-1, num_kv_heads, head_dim)[:seq_len]
        values = read_pages(v_blocks, None, ids, q.dtype).transpose(1, 2).reshape(-1, num_kv_heads, head_dim)[:seq_len]
        if num_queries == seq_len:
            attended = sdpa(q, keys, values, causal=True, scale=scale)
        else:
            pos_q = torch.arange(seq_len - num_queries, seq_len, device=query.device)
            attended = sdpa(q, keys, values, causal_rows_mask(pos_q, seq_len)[None], scale=scale)
        out[start:end] = attended.to(out.dtype)
