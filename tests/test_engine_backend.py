"""The engine's CPU attention backend (`TorchBackend`) against `sparrow.kernels.ReferenceBackend`."""

import pytest
import torch

from sparrow.kernels import ReferenceBackend, SparseAttentionConfig, TorchBackend
from sparrow.kernels.reference import landmark_dtype


def random_paged_batch(seed: int, lengths: list[int], heads=(4, 2), head_dim=16, dtype=torch.float32, num_blocks=64):
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    bs = 16
    k_cache = torch.zeros(num_blocks, hkv, bs, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots, keys, values = [], [], [], []
    for n in lengths:
        nb = -(-n // bs)
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(n)]
        # Keys with a few outlier channels, as real post-RoPE keys have.
        k = torch.randn(n, hkv, head_dim, generator=gen) * (1 + 4 * (torch.arange(head_dim) < 2))
        keys.append(k)
        values.append(torch.randn(n, hkv, head_dim, generator=gen))
    width = max(len(t) for t in tables)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    q = torch.randn(len(lengths), hq, head_dim, generator=gen).to(dtype)
    return q, k_cache, v_cache, torch.tensor(slots), torch.cat(keys).to(dtype), torch.cat(values).to(dtype), block_tables


@pytest.mark.parametrize("landmark", ["mean", "minmax", "mean_int8"])
@pytest.mark.parametrize("budget_kind", ["dense", "sparse", "mixed"])
def test_torch_backend_equals_reference(landmark, budget_kind):
    config = SparseAttentionConfig(landmark=landmark)
    lengths = [16, 37, 160, 201, 95]
    q, k0, v0, slots, k, v, tables = random_paged_batch(0, lengths)
    caches = {}
    for backend in (ReferenceBackend(), TorchBackend()):
        k_cache, v_cache = k0.clone(), v0.clone()
        landmarks = torch.zeros(k_cache.shape[0], k_cache.shape[1], config.landmark_width(k_cache.shape[-1]),
                                dtype=landmark_dtype(landmark, k_cache.dtype))
        # Write in two uneven pieces, like a chunked prefill followed by decode writes.
        backend.write_kv(k_cache, v_cache, landmarks, slots[:150], k[:150], v[:150], config)
        backend.write_kv(k_cache, v_cache, landmarks, slots[150:], k[150:], v[150:], config)
        caches[backend.name] = (k_cache, v_cache, landmarks)
    for ref, ours in zip(caches["reference"], caches["torch"]):
        assert torch.equal(ref, ours)
    seq_lens = torch.tensor(lengths)
    budgets = {"dense": None, "sparse": torch.tensor([3, 4, 5, 6, 3]), "mixed": torch.tensor([1 << 30, 4, 20, 3, 7])}[budget_kind]
    k_cache, v_cache, landmarks = caches["reference"]
    ref_out, ref_counts = ReferenceBackend().decode(q, k_cache, v_cache, landmarks, tables, seq_lens, budgets, config, 0.25)
    out, counts = TorchBackend().decode(q, k_cache, v_cache, landmarks, tables, seq_lens, budgets, config, 0.25)
    assert torch.equal(counts, ref_counts)
    assert (out - ref_out).abs().max().item() < 1e-5


def test_torch_backend_bfloat16_cache_matches_reference():
    config = SparseAttentionConfig()
    q, k_cache, v_cache, slots, k, v, tables = random_paged_batch(1, [70, 130], dtype=torch.bfloat16)
    landmarks = torch.zeros(k_cache.shape[0], k_cache.shape[1], k_cache.shape[-1], dtype=torch.bfloat16)
    TorchBackend().write_kv(k_cache, v_cache, landmarks, slots, k, v, config)
    budgets, seq_lens = torch.tensor([4, 5]), torch.tensor([70, 130])
    ref, ref_counts = ReferenceBackend().decode(q, k_cache, v_cache, landmarks, tables, seq_lens, budgets, config, 0.25)
    out, counts = TorchBackend().decode(q, k_cache, v_cache, landmarks, tables, seq_lens, budgets, config, 0.25)
    assert out.dtype == torch.bfloat16 and torch.equal(counts, ref_counts)
    assert (out.float() - ref.float()).abs().max().item() < 1e-2
