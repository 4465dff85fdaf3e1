"""The block-sparse attention reference: dense parity, selection invariants, landmarks, teacher forcing."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow.kernels import ReferenceBackend, SparseAttentionConfig
from sparrow.kernels.reference import (
    block_sparse_causal_attention,
    block_sparse_decode,
    check_landmark_dtype,
    choice_margin,
    chosen_candidates,
    decode_landmarks,
    landmark_dtype,
    landmarks_from_keys,
    paged_decode_attention,
    score_landmarks,
    score_paged_blocks,
    select_blocks,
    write_kv,
)

BS = 16


def build_cache(lengths, num_kv_heads=2, head_dim=8, mode="mean", seed=0, dtype=torch.float64, token_by_token=False):
    """A paged cache holding random keys/values for sequences of `lengths`, blocks shuffled physically."""
    gen = torch.Generator().manual_seed(seed)
    nblocks = [math.ceil(n / BS) for n in lengths]
    total = sum(nblocks) + 3
    width = SparseAttentionConfig(landmark=mode).landmark_width(head_dim)
    k_cache = torch.zeros(total, num_kv_heads, BS, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    landmarks = torch.zeros(total, num_kv_heads, width, dtype=landmark_dtype(mode, dtype))
    perm = torch.randperm(total, generator=gen)
    tables = torch.zeros(len(lengths), max(nblocks), dtype=torch.long)
    keys, values, used = [], [], 0
    for b, (n, nb) in enumerate(zip(lengths, nblocks)):
        tables[b, :nb] = perm[used : used + nb]
        used += nb
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen, dtype=dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen, dtype=dtype)
        slots = tables[b, torch.arange(n) // BS] * BS + torch.arange(n) % BS
        if token_by_token:
            for t in range(n):
                write_kv(k_cache, v_cache, landmarks, slots[t : t + 1], k[t : t + 1], v[t : t + 1], mode)
        else:
            write_kv(k_cache, v_cache, landmarks, slots, k, v, mode)
        keys.append(k)
        values.append(v)
    return k_cache, v_cache, landmarks, tables, keys, values


def naive_attention(q, k, v):
    group = q.shape[0] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    w = torch.softmax(torch.einsum("hd,thd->ht", q, k) / math.sqrt(q.shape[-1]), dim=-1)
    return torch.einsum("ht,thd->hd", w, v)


def test_dense_paged_attention_equals_naive_attention():
    lengths = [1, 15, 16, 17, 100]
    kc, vc, _, tables, keys, values = build_cache(lengths)
    q = torch.randn(len(lengths), 4, 8, dtype=torch.float64)
    out = paged_decode_attention(q, kc, vc, tables, torch.tensor(lengths))
    for b in range(len(lengths)):
        torch.testing.assert_close(out[b], naive_attention(q[b], keys[b], values[b]), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("mode", ["mean", "minmax"])
def test_sparse_equals_dense_when_budget_covers_context(mode):
    lengths = [5, 40, 100, 160]
    kc, vc, lm, tables, _, _ = build_cache(lengths, mode=mode)
    q = torch.randn(len(lengths), 4, 8, dtype=torch.float64)
    cfg = SparseAttentionConfig(landmark=mode)
    dense = paged_decode_attention(q, kc, vc, tables, torch.tensor(lengths))
    budgets = torch.tensor([math.ceil(n / BS) for n in lengths])
    sparse, counts = block_sparse_decode(q, kc, vc, lm, tables, torch.tensor(lengths), budgets, cfg)
    torch.testing.assert_close(sparse, dense, rtol=0, atol=0)
    assert counts.tolist() == budgets.tolist()


def test_small_budget_differs_from_dense_and_counts_budget():
    lengths = [300, 300]
    kc, vc, lm, tables, _, _ = build_cache(lengths)
    q = torch.randn(2, 4, 8, dtype=torch.float64)
    out, counts = block_sparse_decode(q, kc, vc, lm, tables, torch.tensor(lengths), torch.tensor([5, 19]), SparseAttentionConfig())
    dense = paged_decode_attention(q, kc, vc, tables, torch.tensor(lengths))
    assert counts.tolist() == [5, 19]
    assert (out - dense).abs().max() > 1e-3


@settings(max_examples=60, deadline=None)
@given(
    data=st.data(),
    batch=st.integers(1, 4),
    heads=st.integers(1, 3),
    sink=st.integers(0, 2),
    recent=st.integers(1, 3),
)
def test_selection_invariants(data, batch, heads, sink, recent):
    nblocks = data.draw(st.lists(st.integers(1, 40), min_size=batch, max_size=batch))
    budgets = data.draw(st.lists(st.integers(0, 45), min_size=batch, max_size=batch))
    width = max(nblocks)
    seed = data.draw(st.integers(0, 2**16))
    scores = torch.randn(batch, heads, width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ids, counts = select_blocks(scores, torch.tensor(nblocks), torch.tensor(budgets), sink, recent)
    for b in range(batch):
        n, budget = nblocks[b], max(budgets[b], sink + recent)
        expect = min(n, budget)
        assert counts[b] == expect
        for h in range(heads):
            row = ids[b, h][ids[b, h] >= 0].tolist()
            assert len(row) == expect == len(set(row)), "selected count equals the budget, no duplicates"
            assert row == sorted(row) and all(0 <= i < n for i in row)
            if n <= budget:
                assert row == list(range(n)), "dense when the context fits"
                continue
            assert set(range(min(sink, n))) <= set(row), "sinks always selected"
            assert set(range(n - recent, n)) <= set(row), "recent blocks always selected"
            middle = [i for i in row if sink <= i < n - recent]
            cand = torch.arange(sink, n - recent)
            best = cand[torch.sort(scores[b, h, sink : n - recent], descending=True, stable=True).indices[: budget - sink - recent]]
            assert sorted(best.tolist()) == middle, "exact top-k of the candidates"


@settings(max_examples=30, deadline=None)
@given(data=st.data(), batch=st.integers(2, 4))
def test_selection_of_a_sequence_ignores_the_others(data, batch):
    nblocks = data.draw(st.lists(st.integers(1, 30), min_size=batch, max_size=batch))
    budgets = data.draw(st.lists(st.integers(3, 30), min_size=batch, max_size=batch))
    seed = data.draw(st.integers(0, 2**16))
    scores = torch.randn(batch, 2, max(nblocks), generator=torch.Generator().manual_seed(seed))
    ids, counts = select_blocks(scores, torch.tensor(nblocks), torch.tensor(budgets), 1, 2)
    for b in range(batch):
        alone, c = select_blocks(scores[b : b + 1, :, : nblocks[b]], torch.tensor(nblocks[b : b + 1]), torch.tensor(budgets[b : b + 1]), 1, 2)
        assert c[0] == counts[b]
        assert torch.equal(alone[0], ids[b, :, : alone.shape[-1]])
        assert (ids[b, :, alone.shape[-1] :] == -1).all()


def test_choice_margin_is_the_gap_at_the_cut_over_the_candidates_spread():
    """Candidates 1..4 score 5, 3, 2.9, 1 with a top-2 to choose: chosen 1, 2; the cut lies between 3 and 2.9, a
    gap of 0.1 over a spread of 4. Equal scores are a tie (0); a dense row or one choosing nothing has no cut."""
    scores = torch.tensor([[[0.0, 5.0, 3.0, 2.9, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0, 1.0, 0.0]]])
    n, budget = torch.tensor([6]), torch.tensor([4])
    chosen = chosen_candidates(scores, n, budget, 1, 1)
    assert chosen[0].nonzero().tolist() == [[0, 1], [0, 2], [1, 1], [1, 2]]
    assert choice_margin(scores, n, budget, 1, 1)[0].tolist() == pytest.approx([0.1 / 4, 0.0])
    ids, _ = select_blocks(scores, n, budget, 1, 1)
    assert ids[0, 0].tolist() == [0, 1, 2, 5], "the blocks chosen by score, with sink and recent around them"
    assert (choice_margin(scores, torch.tensor([4]), budget, 1, 1) == float("inf")).all(), "dense: no choice"
    assert (choice_margin(scores, n, torch.tensor([2]), 1, 1) == float("inf")).all(), "sink and recent only"
    assert not chosen_candidates(scores, torch.tensor([4]), budget, 1, 1).any()


def test_ties_go_to_the_lower_block_index():
    scores = torch.zeros(1, 1, 10)
    scores[0, 0, 7] = 1.0
    ids, _ = select_blocks(scores, torch.tensor([10]), torch.tensor([6]), 1, 2)
    # candidates 1..7: block 7 wins on score, then the tied blocks 1, 2 by index
    assert ids[0, 0].tolist() == [0, 1, 2, 7, 8, 9]


def test_nan_scores_are_never_preferred():
    scores = torch.full((1, 1, 10), float("nan"))
    scores[0, 0, 5] = -100.0
    ids, _ = select_blocks(scores, torch.tensor([10]), torch.tensor([4]), 1, 2)
    assert ids[0, 0].tolist() == [0, 5, 8, 9]


def test_all_nan_rows_still_fill_the_budget_by_index():
    ids, counts = select_blocks(torch.full((1, 1, 10), float("nan")), torch.tensor([10]), torch.tensor([6]), 1, 2)
    assert counts.tolist() == [6] and ids[0, 0].tolist() == [0, 1, 2, 3, 8, 9]


@pytest.mark.parametrize("length", [1, 15, 16, 17, 31, 32, 33, 70])
def test_mean_landmarks_written_when_block_fills(length):
    kc, _, lm, tables, keys, _ = build_cache([length], token_by_token=True)
    full = length // BS
    expect = landmarks_from_keys(keys[0], BS, "mean")
    for blk in range(math.ceil(length / BS)):
        phys = tables[0, blk]
        if blk < full:
            torch.testing.assert_close(lm[phys], expect[blk], rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(lm[phys], keys[0][blk * BS : (blk + 1) * BS].mean(0))
        else:
            assert torch.all(lm[phys] == 0), "a partial block has no landmark yet"


@pytest.mark.parametrize("length", [1, 15, 16, 17, 40])
def test_minmax_landmarks_are_exact_for_partial_and_full_blocks(length):
    kc, _, lm, tables, keys, _ = build_cache([length], mode="minmax", token_by_token=True)
    for blk in range(math.ceil(length / BS)):
        chunk = keys[0][blk * BS : min((blk + 1) * BS, length)]
        d = chunk.shape[-1]
        torch.testing.assert_close(lm[tables[0, blk], :, :d], chunk.amax(0), rtol=0, atol=0)
        torch.testing.assert_close(lm[tables[0, blk], :, d:], chunk.amin(0), rtol=0, atol=0)


def test_bulk_write_equals_token_by_token_write():
    bulk = build_cache([70, 33], mode="minmax", seed=3)
    step = build_cache([70, 33], mode="minmax", seed=3, token_by_token=True)
    for a, b in zip(bulk[:3], step[:3]):
        assert torch.equal(a, b)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), group=st.sampled_from([1, 2, 4]))
def test_minmax_score_bounds_every_key_in_the_block(seed, group):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(64, 2, 8, generator=gen, dtype=torch.float64)
    q = torch.randn(2 * group, 8, generator=gen, dtype=torch.float64)
    lms = landmarks_from_keys(keys, BS, "minmax")
    q_mean = q.view(2, group, 8).mean(1)
    scores = score_landmarks(q_mean, lms, "minmax")  # [H, blocks]
    dots = torch.einsum("hd,thd->ht", q_mean, keys).view(2, 4, BS)
    assert torch.all(scores >= dots.amax(-1) - 1e-12)


def test_mean_score_is_group_mean_query_dot_mean_key():
    kc, _, lm, tables, keys, _ = build_cache([64])
    q = torch.randn(1, 4, 8, dtype=torch.float64)
    scores = score_paged_blocks(q, lm, tables, torch.tensor([4]), "mean")
    for h in range(2):
        qm = q[0, 2 * h : 2 * h + 2].mean(0)
        for blk in range(4):
            expect = qm @ keys[0][blk * BS : (blk + 1) * BS, h].mean(0)
            torch.testing.assert_close(scores[0, h, blk], expect)


@pytest.mark.parametrize("length", [15, 16, 33, 70])
def test_int8_landmarks_round_the_mean_key(length):
    """`mean_int8`: each full block's row holds the mean key in int8 steps of amax / 127 and its float32 scale; it reads
    back within half a step of the mean, the paged write and the from-scratch landmarks agree, and a block scores
    as its rounded mean key does."""
    kc, _, lm, tables, keys, _ = build_cache([length], mode="mean_int8", token_by_token=True)
    assert lm.dtype == torch.int8 and lm.shape[-1] == 16  # 8 values, the scale, 4 bytes of padding
    expect = landmarks_from_keys(keys[0], BS, "mean_int8")
    for blk in range(length // BS):
        row = lm[tables[0, blk]]
        assert torch.equal(row, expect[blk])
        mean = keys[0][blk * BS : (blk + 1) * BS].mean(0).float()
        step = mean.abs().amax(-1, keepdim=True) / 127
        assert ((decode_landmarks(row, "mean_int8", 8) - mean).abs() <= step / 2 * (1 + 1e-5)).all()
        assert (row[..., 12:] == 0).all(), "the padding is zero"
        assert row[..., :8].abs().amax(-1).tolist() == [127, 127], "the largest element maps to 127"
    q = torch.randn(1, 4, 8, dtype=torch.float64)
    scores = score_paged_blocks(q, lm, tables, torch.tensor([length // BS]), "mean_int8")
    rounded = decode_landmarks(lm, "mean_int8", 8).double()
    torch.testing.assert_close(scores, score_paged_blocks(q, rounded, tables, torch.tensor([length // BS]), "mean"))
    assert SparseAttentionConfig(landmark="mean_int8").landmark_bytes(128, 2) == 144  # bf16 mean key: 256 bytes
    with pytest.raises(ValueError, match="multiple of 4"):
        SparseAttentionConfig(landmark="mean_int8").landmark_width(30)
    with pytest.raises(ValueError, match="mean_int8 landmarks, and only they, are int8"):
        check_landmark_dtype(lm.float(), "mean_int8")
    with pytest.raises(ValueError, match="mean_int8 landmarks, and only they, are int8"):
        check_landmark_dtype(lm, "mean")


@pytest.mark.parametrize("mode", ["mean", "minmax", "mean_int8"])
def test_teacher_forced_attention_equals_step_by_step_decode(mode):
    """The trainer's sparse forward sees exactly what the rollout engine saw at each step."""
    length = 150
    kc, vc, lm, tables, keys, values = build_cache([length], mode=mode, token_by_token=True)
    cfg = SparseAttentionConfig(landmark=mode)
    q = torch.randn(length, 4, 8, dtype=torch.float64)
    budgets = torch.where(torch.arange(length) < 20, 10**6, 5)
    forced = block_sparse_causal_attention(q, keys[0], values[0], budgets, cfg)
    for t in range(length):
        step, _ = block_sparse_decode(q[t : t + 1], kc, vc, lm, tables, torch.tensor([t + 1]), budgets[t : t + 1], cfg)
        torch.testing.assert_close(forced[t], step[0], rtol=1e-10, atol=1e-12)


def test_reference_backend_dense_and_sparse_paths():
    lengths = [40, 90]
    kc, vc, lm, tables, _, _ = build_cache(lengths)
    q = torch.randn(2, 4, 8, dtype=torch.float64)
    backend, cfg = ReferenceBackend(), SparseAttentionConfig()
    dense, dense_counts = backend.decode(q, kc, vc, None, tables, torch.tensor(lengths), None, cfg, 8**-0.5)
    assert dense_counts.tolist() == [3, 6]
    sparse, counts = backend.decode(q, kc, vc, lm, tables, torch.tensor(lengths), torch.tensor([4, 4]), cfg, 8**-0.5)
    assert counts.tolist() == [3, 4]
    torch.testing.assert_close(sparse[0], dense[0])


def test_float32_inputs_stay_accurate():
    lengths = [200]
    kc, vc, lm, tables, _, _ = build_cache(lengths)
    q = torch.randn(1, 4, 8, dtype=torch.float64)
    ref = paged_decode_attention(q, kc, vc, tables, torch.tensor(lengths))
    out32 = paged_decode_attention(q.float(), kc.float(), vc.float(), tables, torch.tensor(lengths))
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), ref, rtol=1e-5, atol=1e-6)


def test_config_rejects_bad_values():
    with pytest.raises(ValueError, match="recent=0"):
        SparseAttentionConfig(recent=0)
    with pytest.raises(ValueError, match="landmark='max'"):
        SparseAttentionConfig(landmark="max")
