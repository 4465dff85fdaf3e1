"""FlashInfer's paged decode attention on Sparrow's KV pool: the peer kernel `sparrow bench kernels` compares with.

vLLM and SGLang decode through FlashInfer's `BatchDecodeWithPagedKVCacheWrapper`. Sparrow's pool
`[blocks, H_kv, block_size, D]` is FlashInfer's "HND" layout with pages of `block_size` tokens, so the same memory
is read by both. FlashInfer takes a page table in CSR form (`indptr`, `indices`, `last_page_len`) shared by all KV
heads of a request; Sparrow selects blocks per (sequence, KV head). The sparse comparison therefore views the pool
as one KV head per page (`[blocks · H_kv, 1, block_size, D]`, page id = block · H_kv + head) and runs each
(sequence, KV head) row as its own request with its G query heads: the same blocks, read by FlashInfer's kernel.

The page-table conversions are plain torch (tested on the CPU against the reference attention); timing needs a
CUDA GPU and the `flashinfer-python` package (`benchmarks/flashinfer_stage.sh` carries it to a GPU machine).
"""

from dataclasses import dataclass

import torch

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace


@dataclass(frozen=True)
class PageTable:
    """FlashInfer's paged-KV description of R requests: request r reads pages `indices[indptr[r]:indptr[r+1]]`,
    all full except the last, which holds `last_page_len[r]` tokens."""

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor


def csr_page_table(pages: torch.Tensor, counts: torch.Tensor, lengths: torch.Tensor, block_size: int) -> PageTable:
    """Rows of `pages: [R, W]` (the first `counts[r]` entries are request r's pages, its partial page last) and
    `lengths: [R]` tokens of each request's context → a `PageTable` in int32."""
    counts = counts.long()
    if pages.shape[0] != counts.shape[0] or lengths.shape[0] != counts.shape[0]:
        raise ValueError(f"pages {tuple(pages.shape)}, counts {tuple(counts.shape)} and lengths "
                         f"{tuple(lengths.shape)} must describe the same requests")
    if counts.numel() and int(counts.max()) > pages.shape[1]:
        raise ValueError(f"a request lists {int(counts.max())} pages but the table holds {pages.shape[1]} per row")
    listed = torch.arange(pages.shape[1], device=pages.device)[None, :] < counts[:, None]
    indptr = torch.zeros(counts.shape[0] + 1, dtype=torch.int32, device=pages.device)
    indptr[1:] = torch.cumsum(counts, 0)
    lengths = lengths.long()
    last = lengths - (torch.div(lengths + block_size - 1, block_size, rounding_mode="floor") - 1) * block_size
    return PageTable(indptr, pages[listed].int(), last.int())


def dense_page_table(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> PageTable:
    """Every block of every sequence: FlashInfer's ordinary paged decode over Sparrow's block tables."""
    blocks = torch.div(seq_lens.long() + block_size - 1, block_size, rounding_mode="floor")
    return csr_page_table(block_tables, blocks, seq_lens, block_size)


def sparse_page_table(block_tables: torch.Tensor, seq_lens: torch.Tensor, selected: torch.Tensor, counts: torch.Tensor,
                      num_kv_heads: int, block_size: int) -> PageTable:
    """One request per (sequence, KV head) over the per-head page view: the blocks Sparrow's selection chose.

    `selected: [B·H_kv, ≥M]` and `counts: [B]` as `sparrow.kernels.triton.select_blocks` writes them (physical
    block ids, the partial block last); a sequence whose count is all its blocks fit its budget: its rows are
    dense, left unwritten by the selection, and read `block_tables`."""
    bsz, width = block_tables.shape
    heads = torch.arange(num_kv_heads, device=block_tables.device)
    blocks = torch.div(seq_lens.long() + block_size - 1, block_size, rounding_mode="floor")
    dense = (counts.long() >= blocks).repeat_interleave(num_kv_heads)
    chosen = selected[: bsz * num_kv_heads, :width].long()
    physical = torch.where(dense[:, None], block_tables.long().repeat_interleave(num_kv_heads, dim=0), chosen)
    pages = physical * num_kv_heads + heads.repeat(bsz)[:, None]
    row_counts = torch.where(dense, blocks.repeat_interleave(num_kv_heads), counts.long().repeat_interleave(num_kv_heads))
    return csr_page_table(pages, row_counts, seq_lens.repeat_interleave(num_kv_heads), block_size)


def per_head_pages(cache: torch.Tensor) -> torch.Tensor:
    """`[blocks, H_kv, bs, D]` → `[blocks · H_kv, 1, bs, D]` (a view: page id = block · H_kv + head)."""
    blocks, heads, block_size, head_dim = cache.shape
    return cache.view(blocks * heads, 1, block_size, head_dim)


def available() -> str | None:
    """None when FlashInfer can be used here, else why not (shown in the benchmark's output and JSON)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # ImportError, or a missing CUDA library under it
        return f"flashinfer-python cannot be imported ({type(exc).__name__}: {exc}); see benchmarks/flashinfer_stage.sh"
    return None


def version() -> str:
    """FlashInfer's version; call only where `available()` said it can be used."""
    import flashinfer

    return getattr(flashinfer, "__version__", "unknown")


class FlashInferDecode:
    """A planned FlashInfer paged decode (`kv_layout="HND"`, CUDA-graph buffers), ready to run or capture."""

    def __init__(self, table: PageTable, num_qo_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 dtype: torch.dtype, scale: float):
        import flashinfer

        device = table.indices.device
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # Tensor cores pay off from 4 query heads per KV head (FlashInfer's own guidance for GQA decode).
        self.wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, kv_layout="HND", use_cuda_graph=True,
            use_tensor_cores=num_qo_heads // num_kv_heads >= 4,
            paged_kv_indptr_buffer=table.indptr, paged_kv_indices_buffer=table.indices,
            paged_kv_last_page_len_buffer=table.last_page_len,
        )
        self.wrapper.plan(table.indptr, table.indices, table.last_page_len, num_qo_heads, num_kv_heads, head_dim,
                          block_size, q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return self.wrapper.run(q, (k_cache, v_cache), out=out)
