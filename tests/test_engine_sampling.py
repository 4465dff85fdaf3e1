"""Sampling: draws follow the filtered distribution, logprobs stay unfiltered, seeds reproduce, stops work."""

import torch

from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine
from sparrow.rollout_workers.native.sampler import SamplingBatch, filter_mask, sample


def draw_many(logits: torch.Tensor, params: SamplingParams, draws: int) -> torch.Tensor:
    rows = logits.expand(draws, -1)
    batch = SamplingBatch.build([params] * draws, [params.seed or 0] * draws, list(range(draws)), "cpu")
    return sample(rows, batch)


def test_draw_frequencies_follow_the_tempered_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    for params in (SamplingParams(temperature=0.7, seed=1), SamplingParams(temperature=1.3, top_k=3, seed=2),
                   SamplingParams(temperature=1.0, top_p=0.8, seed=3)):
        out = draw_many(logits, params, 20000)
        scaled = logits / params.temperature
        keep = filter_mask(scaled, torch.tensor([params.top_k]), torch.tensor([params.top_p]))
        target = torch.softmax(scaled.masked_fill(~keep, float("-inf")), dim=-1)[0]
        freq = torch.bincount(out.tokens, minlength=6).double() / 20000
        assert (freq - target).abs().max().item() < 0.015, (params, freq, target)
        # Logprobs are the unfiltered tempered log-softmax, whatever the filter did.
        full = torch.log_softmax(scaled, dim=-1)[0]
        assert torch.allclose(out.logprobs, full[out.tokens])
        assert torch.allclose(out.top_logprobs[0], full.sort(descending=True).values)


def test_filter_mask_top_k_then_top_p():
    scaled = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert filter_mask(scaled, torch.tensor([2]), torch.tensor([1.0])).tolist() == [[True, True, False, False, False]]
    assert filter_mask(scaled, torch.tensor([0]), torch.tensor([0.6])).tolist() == [[True, True, False, False, False]]
    # top-p over the top-3 renormalised (0.59, 0.24, 0.18): 0.7 keeps two.
    assert filter_mask(scaled, torch.tensor([3]), torch.tensor([0.7])).tolist() == [[True, True, False, False, False]]
    assert filter_mask(scaled, torch.tensor([0]), torch.tensor([0.01])).tolist() == [[True, False, False, False, False]]


def test_greedy_uses_argmax_and_temperature_one_logprobs():
    logits = torch.tensor([[0.3, 2.0, -1.0], [1.0, 0.0, 5.0]])
    batch = SamplingBatch.build([SamplingParams(temperature=0)] * 2, [0, 0], [0, 0], "cpu")
    out = sample(logits, batch)
    assert out.tokens.tolist() == [1, 2]
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1).gather(-1, out.tokens[:, None])[:, 0])


def test_non_finite_logits_are_flagged():
    logits = torch.tensor([[0.0, float("nan")], [0.0, 1.0], [float("inf"), 0.0]])
    batch = SamplingBatch.build([SamplingParams(temperature=1.0, seed=0)] * 3, [0] * 3, [0] * 3, "cpu")
    assert sample(logits, batch).finite.tolist() == [False, True, False]


def run(engine, prompts, **sampling):
    requests = [RolloutRequest(f"r{i}", tuple(p), SamplingParams(**sampling)) for i, p in enumerate(prompts)]
    return engine.generate(requests)


def test_seeded_samples_do_not_depend_on_the_batch(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=128)
    prompt = list(range(5, 30))
    alone = run(engine, [prompt], max_tokens=24, temperature=1.0, seed=7, ignore_eos=True)[0]
    crowd = run(engine, [list(range(40, 90)), prompt, list(range(3, 9))], max_tokens=24, temperature=1.0, seed=7,
                ignore_eos=True)
    assert torch.equal(alone.token_ids, crowd[1].token_ids)
    assert torch.allclose(alone.logprobs, crowd[1].logprobs, atol=1e-5)
    group = run(engine, [prompt], max_tokens=24, temperature=1.0, seed=7, n=4, ignore_eos=True)
    assert len({tuple(s.token_ids.tolist()) for s in group}) == 4  # samples of one request differ
    assert torch.equal(group[0].token_ids, alone.token_ids)  # and sample 0 is the n=1 sample


def test_stop_conditions(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=128)
    prompt = list(range(5, 30))
    free = run(engine, [prompt], max_tokens=12, temperature=0, ignore_eos=True)[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_at = free.token_ids[5].item()
    first = free.token_ids.tolist().index(stop_at)
    stopped = run(engine, [prompt], max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(stop_at,))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids.tolist() == free.token_ids[: first + 1].tolist()
    engine.scheduler.eos_token_ids = frozenset({stop_at})
    eos = run(engine, [prompt], max_tokens=12, temperature=0)[0]
    assert eos.finish_reason == "stop" and len(eos.token_ids) == first + 1
    no_logprobs = run(engine, [prompt], max_tokens=3, temperature=0, logprobs=0, ignore_eos=True)[0]
    assert no_logprobs.top_ids.shape == (3, 0)


def test_each_sample_keeps_its_own_number_of_top_logprobs_past_the_history_growth(tiny_qwen3):
    """A batch's top lists are as wide as its widest request; each sample keeps its own k, for every one of its
    tokens (100 here: the host record grows past its first 64 rows), and matches the same request run alone."""
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=128)
    prompt = list(range(5, 30))
    requests = [RolloutRequest(f"k{k}", tuple(prompt), SamplingParams(max_tokens=100, temperature=1.0, seed=3,
                                                                       logprobs=k, ignore_eos=True)) for k in (2, 5)]
    together = engine.generate(requests)
    for request, sample in zip(requests, together):
        k = request.sampling.logprobs
        alone = engine.generate([request])[0]
        assert sample.top_ids.shape == sample.top_logprobs.shape == (100, k)
        assert sample.logprobs.shape == sample.blocks_attended.shape == (100,)
        assert torch.equal(sample.token_ids, alone.token_ids) and torch.equal(sample.top_ids, alone.top_ids)
        assert torch.allclose(sample.top_logprobs, alone.top_logprobs, atol=1e-5)
        assert torch.equal(sample.blocks_attended, alone.blocks_attended)
        assert (sample.top_logprobs[:, :-1] >= sample.top_logprobs[:, 1:]).all()
        sampled = sample.top_ids == sample.token_ids[:, None]
        assert torch.allclose(sample.top_logprobs[sampled], sample.logprobs[sampled.any(1)], atol=1e-6)
