"""The FlashInfer comparison's page tables (sparrow.bench.decode_kernels.flashinfer_baseline): attention read
through them, the way FlashInfer's "HND" paged decode reads a page table, equals Sparrow's reference attention over
the same blocks."""

import pytest
import torch

from sparrow.bench.decode_kernels.flashinfer_baseline import (
    PageTable,
    csr_page_table,
    dense_page_table,
    per_head_pages,
    sparse_page_table,
)
from sparrow.kernels.reference import paged_decode_attention, score_paged_blocks, select_blocks

BS, H_KV, GROUP, D = 16, 2, 3, 8


def csr_decode(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, table: PageTable) -> torch.Tensor:
    """FlashInfer's paged decode semantics in plain torch: `q: [R, H_q, D]`, pages `[P, H_kv, bs, D]` (HND);
    request r attends every token of its listed pages, the last one up to `last_page_len[r]`."""
    rows, num_q_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_pages.shape
    out = torch.empty_like(q)
    for r in range(rows):
        pages = table.indices[table.indptr[r]:table.indptr[r + 1]].long()
        tokens = (len(pages) - 1) * block_size + int(table.last_page_len[r])
        keys = k_pages[pages].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :tokens]
        values = v_pages[pages].permute(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)[:, :tokens]
        qg = q[r].view(num_kv_heads, num_q_heads // num_kv_heads, head_dim)
        probs = torch.softmax(torch.einsum("hgd,htd->hgt", qg, keys) * head_dim**-0.5, dim=-1)
        out[r] = torch.einsum("hgt,htd->hgd", probs, values).reshape(num_q_heads, head_dim)
    return out


def pool_and_batch(seed: int, head_dim: int = D):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([75, 160, 23, 130])  # partial, full, one block, partial
    width = int((lengths + BS - 1).div(BS, rounding_mode="floor").max())
    blocks = 64
    k = torch.randn(blocks, H_KV, BS, head_dim, generator=gen, dtype=torch.float64)
    v = torch.randn(blocks, H_KV, BS, head_dim, generator=gen, dtype=torch.float64)
    tables = torch.randperm(blocks, generator=gen)[: len(lengths) * width].view(len(lengths), width).int()
    q = torch.randn(len(lengths), H_KV * GROUP, head_dim, generator=gen, dtype=torch.float64)
    return k, v, tables, lengths.int(), q


def test_the_dense_page_table_reads_every_token_of_every_sequence():
    k, v, tables, lengths, q = pool_and_batch(0)
    table = dense_page_table(tables, lengths, BS)
    assert table.indptr.tolist() == [0, 5, 15, 17, 26]
    assert table.last_page_len.tolist() == [11, 16, 7, 2]
    assert table.indices.dtype == torch.int32 and table.indices.tolist()[:5] == tables[0, :5].tolist()
    torch.testing.assert_close(csr_decode(q, k, v, table), paged_decode_attention(q, k, v, tables, lengths),
                               rtol=1e-12, atol=1e-12)


def test_the_sparse_page_table_reads_the_selected_blocks_one_request_per_kv_head():
    k, v, tables, lengths, q = pool_and_batch(1)
    landmarks = k.mean(dim=2)
    blocks = (lengths.long() + BS - 1) // BS
    budgets = torch.tensor([4, 4, 8, 5])  # the third sequence (2 blocks) fits its budget: dense
    logical, counts = select_blocks(score_paged_blocks(q, landmarks, tables, blocks), blocks, budgets, 1, 2)
    # select_blocks (Triton) writes physical ids per (sequence, KV head) row and leaves dense rows untouched
    physical = torch.gather(tables.long(), 1, logical.clamp(min=0).flatten(1)).view_as(logical)
    selected = torch.full((len(lengths) * H_KV, tables.shape[1] + 3), -7, dtype=torch.int32)
    selected[:, : logical.shape[-1]] = torch.where(logical >= 0, physical, -7).flatten(0, 1).int()
    selected[2 * H_KV: 3 * H_KV] = -7

    table = sparse_page_table(tables, lengths, selected, counts, H_KV, BS)
    assert table.indptr.diff().tolist() == [4, 4, 4, 4, 2, 2, 5, 5]
    assert int(table.indices.min()) >= 0
    got = csr_decode(q.view(-1, GROUP, D), per_head_pages(k), per_head_pages(v), table).view_as(q)
    want = paged_decode_attention(q, k, v, tables, lengths, logical)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_per_head_view_is_the_same_memory():
    k = torch.arange(3 * H_KV * BS * D, dtype=torch.float32).view(3, H_KV, BS, D)
    pages = per_head_pages(k)
    assert pages.data_ptr() == k.data_ptr() and pages.shape == (3 * H_KV, 1, BS, D)
    assert torch.equal(pages[2 * H_KV + 1, 0], k[2, 1])


def test_a_table_that_lists_more_pages_than_it_holds_is_refused():
    with pytest.raises(ValueError, match="lists 5 pages but the table holds 4"):
        csr_page_table(torch.zeros(2, 4, dtype=torch.int32), torch.tensor([5, 1]), torch.tensor([70, 3]), BS)


def test_the_kernel_tables_show_flashinfer_beside_ours_and_a_dash_where_it_did_not_run():
    from sparrow.bench.decode_kernels.tables import render_tables

    dense = {"kind": "dense", "batch": 8, "context": 32768, "group": 4, "splits": 2, "us": 90.0, "pct_copy": 95.0,
             "zero_flush_us": 100.0, "sdpa_us": 120.0, "sdpa_pct_copy": 70.0, "sdpa_backend": "flash",
             "rel_err_vs_sdpa": 1e-3}
    sparse = {"kind": "sparse", "batch": 8, "context": 32768, "group": 4, "landmark": "mean", "budget_tokens": 2048,
              "score_us": 10.0, "score_pct_copy": 50.0, "select_us": 8.0, "attn_us": 9.0, "attn_pct_copy": 60.0,
              "merge_us": 3.0, "layer_us": 30.0, "layer_pct_copy": 40.0, "speedup_vs_dense": 3.0}
    report = {"device": "GPU", "copy_GBps": 4000.0, "launch_floor_us": 2.0, "results": [
        {**dense, "flashinfer_us": 100.0, "flashinfer_pct_copy": 85.5},
        {**dense, "context": 8192, "flashinfer_us": None},
        {**sparse, "flashinfer_us": 16.0},
        sparse,
    ]}
    lines = render_tables(report).splitlines()
    row = next(line for line in lines if "32768" in line and "flash " in line)
    assert row.split()[-3:] == ["100.0", "86", "0.90"]
    assert next(line for line in lines if " 8192 " in line).split()[-3:] == ["-", "-", "-"]
    sparse_rows = [line for line in lines if "mean" in line]
    assert sparse_rows[0].split()[-2:] == ["16.0", "0.75"] and sparse_rows[1].split()[-2:] == ["-", "-"]


@pytest.mark.gpu
def test_flashinfer_reads_sparrows_pool_as_the_reference_does():
    from sparrow.bench.decode_kernels import flashinfer_baseline as flashinfer

    missing = flashinfer.available()
    if missing:
        pytest.skip(missing)
    head_dim = 128  # FlashInfer builds kernels for the head sizes models use
    k, v, tables, lengths, q = (t.cuda() for t in pool_and_batch(2, head_dim))
    k, v, q = k.bfloat16(), v.bfloat16(), q.bfloat16()
    table = dense_page_table(tables, lengths, BS)
    decode = flashinfer.FlashInferDecode(table, H_KV * GROUP, H_KV, head_dim, BS, torch.bfloat16, head_dim**-0.5)
    got = decode.run(q, k, v, torch.empty_like(q))
    torch.testing.assert_close(got.float(), paged_decode_attention(q, k, v, tables, lengths).float(), rtol=2e-2, atol=2e-2)
