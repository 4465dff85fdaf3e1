"""Acceptance statistics: exact α, guaranteed top-k intervals, mergeable per-bin histograms."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow.acceptance import AlphaHistogram, acceptance_bounds_topk, acceptance_exact


def random_pair(seed, vocab=50, batch=8, sharpness=3.0):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(batch, vocab, generator=gen, dtype=torch.float64) * sharpness
    noise = torch.randn(batch, vocab, generator=gen, dtype=torch.float64) * torch.rand(batch, 1, generator=gen, dtype=torch.float64)
    return torch.log_softmax(base, -1), torch.log_softmax(base + noise, -1)


def test_exact_alpha_is_one_minus_total_variation():
    logp, logq = random_pair(0)
    tv = 0.5 * (logp.exp() - logq.exp()).abs().sum(-1)
    torch.testing.assert_close(acceptance_exact(logp, logq), 1 - tv)
    torch.testing.assert_close(acceptance_exact(logp, logp), torch.ones(8, dtype=torch.float64))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 2**20), k=st.integers(1, 50), sharp=st.floats(0.1, 8.0))
def test_topk_interval_always_contains_exact_alpha(seed, k, sharp):
    logp, logq = random_pair(seed, sharpness=sharp)
    exact = acceptance_exact(logp, logq)
    p_lp, p_ids = logp.topk(k, -1)
    q_lp, q_ids = logq.topk(k, -1)
    lower, upper = acceptance_bounds_topk(p_ids, p_lp, q_ids, q_lp)
    assert torch.all(lower <= exact + 1e-12) and torch.all(exact <= upper + 1e-12)
    assert torch.all(lower >= 0) and torch.all(upper <= 1)


def test_full_lists_give_the_exact_value():
    logp, logq = random_pair(1)
    p_lp, p_ids = logp.topk(50, -1)
    q_lp, q_ids = logq.topk(50, -1)
    lower, upper = acceptance_bounds_topk(p_ids, p_lp, q_ids, q_lp)
    exact = acceptance_exact(logp, logq)
    torch.testing.assert_close(lower, exact)
    torch.testing.assert_close(upper, exact)


def test_lower_bound_is_sparrows_top20_intersection():
    logp, logq = random_pair(2, vocab=200)
    p_lp, p_ids = logp.topk(20, -1)
    q_lp, q_ids = logq.topk(20, -1)
    lower, _ = acceptance_bounds_topk(p_ids, p_lp, q_ids, q_lp)
    for b in range(8):  # Sparrow's sum_min_from_topk: Σ over matching ids of exp(min(logp1, logp2))
        expect = sum(
            float(torch.exp(torch.minimum(p_lp[b, i], q_lp[b, j])))
            for i in range(20) for j in range(20) if p_ids[b, i] == q_ids[b, j]
        )
        assert abs(float(lower[b]) - expect) < 1e-12


def test_padding_entries_are_ignored():
    logp, logq = random_pair(3)
    p_lp, p_ids = logp.topk(10, -1)
    q_lp, q_ids = logq.topk(10, -1)
    pad_ids = torch.full((8, 5), -1)
    pad_lp = torch.zeros(8, 5, dtype=torch.float64)
    a = acceptance_bounds_topk(p_ids, p_lp, q_ids, q_lp)
    b = acceptance_bounds_topk(torch.cat([p_ids, pad_ids], -1), torch.cat([p_lp, pad_lp], -1),
                               torch.cat([q_ids, pad_ids], -1), torch.cat([q_lp, pad_lp], -1))
    torch.testing.assert_close(a, b)


def test_interval_is_tight_when_distributions_are_peaked():
    logp, logq = random_pair(4, vocab=1000, sharpness=12.0)
    p_lp, p_ids = logp.topk(20, -1)
    q_lp, q_ids = logq.topk(20, -1)
    lower, upper = acceptance_bounds_topk(p_ids, p_lp, q_ids, q_lp)
    assert float((upper - lower).max()) < 0.05


def nearest_rank(values, pct):
    s = np.sort(values)
    return s[max(int(np.ceil(pct / 100 * len(s))) - 1, 0)]


@pytest.mark.parametrize("pct", [1, 5, 50, 95])
def test_histogram_percentiles_within_a_thousandth(pct):
    rng = np.random.default_rng(0)
    alpha = np.concatenate([1 - rng.beta(0.3, 6.0, 400_000), rng.uniform(0.5, 1.0, 20_000)]).clip(0, 1)
    bins = rng.integers(0, 20, alpha.size)
    hist = AlphaHistogram.empty().add(torch.tensor(alpha), torch.tensor(bins))
    got = hist.percentile(pct)
    for b in range(20):
        sel = alpha[bins == b]
        assert abs(float(got[b]) - nearest_rank(sel, pct)) <= 1 / hist.resolution + 1e-12
        assert abs(float(got[b]) - np.percentile(sel, pct)) <= 1e-3
    torch.testing.assert_close(hist.mean(), torch.tensor([alpha[bins == b].mean() for b in range(20)], dtype=torch.float64))


def test_histograms_merge_across_workers_and_steps():
    rng = np.random.default_rng(1)
    parts, full = [], AlphaHistogram.empty()
    everything_a, everything_b = [], []
    for worker in range(4):
        a = torch.tensor(rng.beta(8, 1, 3000))
        b = torch.tensor(rng.integers(0, 20, 3000))
        parts.append(AlphaHistogram.empty().add(a, b))
        everything_a.append(a)
        everything_b.append(b)
    merged = parts[0]
    for p in parts[1:]:
        merged = merged.merge(p)
    full.add(torch.cat(everything_a), torch.cat(everything_b))
    assert torch.equal(merged.counts, full.counts)
    torch.testing.assert_close(merged.sums, full.sums)
    assert torch.equal(AlphaHistogram.from_dict(merged.to_dict()).counts, merged.counts)


def test_histogram_edges_empty_bins_and_errors():
    hist = AlphaHistogram.empty(num_length_bins=3).add(torch.tensor([0.0, 1.0, 1.0]), torch.tensor([0, 0, 2]))
    assert hist.count().tolist() == [2, 0, 3 - 2]
    assert torch.isnan(hist.percentile(5)[1]) and torch.isnan(hist.mean()[1])
    assert float(hist.percentile(100)[2]) == pytest.approx(1.0)
    assert [row["bin"] for row in hist.summary()] == [0, 2]
    with pytest.raises(ValueError, match="NaN"):
        hist.add(torch.tensor([float("nan")]), torch.tensor([0]))
    with pytest.raises(ValueError, match="length bin out of range"):
        hist.add(torch.tensor([0.5]), torch.tensor([3]))
    with pytest.raises(ValueError, match="cannot merge"):
        hist.merge(AlphaHistogram.empty())
