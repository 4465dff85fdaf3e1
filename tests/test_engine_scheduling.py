"""Scheduler behaviour: prefix sharing in GRPO groups, preemption by recompute, chunked prefill,
continuous batching and streaming all leave the samples exactly as an unconstrained run makes them."""

import asyncio

import pytest
import torch

from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine
from sparrow.schedule import SparsitySchedule

SMALL = SparsitySchedule(name="small", topk_blocks=(2,), edges=())  # 5 blocks


def requests(n=2, max_tokens=(40, 25, 33), prompt_lens=(67, 40, 90)):
    return [RolloutRequest(f"r{i}", tuple(range(3 + i, 3 + i + p)),
                           SamplingParams(max_tokens=m, temperature=1.0, seed=10 + i, n=n, ignore_eos=True))
            for i, (p, m) in enumerate(zip(prompt_lens, max_tokens))]


def assert_same_samples(a, b, atol=1e-5):
    assert [(s.request_id, s.sample_index) for s in a] == [(s.request_id, s.sample_index) for s in b]
    for x, y in zip(a, b):
        assert x.finish_reason == y.finish_reason
        assert torch.equal(x.token_ids, y.token_ids)
        assert torch.equal(x.blocks_attended, y.blocks_attended)
        assert (x.logprobs - y.logprobs).abs().max().item() < atol


def test_group_samples_share_full_prompt_blocks(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=64)
    prompt = tuple(range(3, 43))  # 2 full blocks + 8 tokens
    engine.add_request(RolloutRequest("g", prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=1, n=4, ignore_eos=True)))
    engine.step()  # prefill once, then fork into 4 samples
    seqs = engine.scheduler.running
    assert len(seqs) == 4
    shared = seqs[0].block_table[:2]
    assert all(s.block_table[:2] == shared for s in seqs)
    assert len({s.block_table[2] for s in seqs}) == 4  # the partial block was copied per sample
    assert [engine.scheduler.blocks.ref_count(b) for b in shared] == [4, 4]
    assert engine.scheduler.blocks.num_used == 2 + 4  # 12 without sharing
    assert engine.stats()["prefix_blocks_saved"] == 6
    assert engine.stats()["kv_blocks_shared"] == 2
    samples = []
    while engine.has_unfinished():
        samples += engine.step()
        blocks = engine.scheduler.blocks  # the kept count equals a scan of the references
        assert blocks.num_shared == sum(blocks.ref_count(b) > 1 for b in range(blocks.num_blocks))
    assert engine.scheduler.blocks.num_used == 0 and engine.stats()["kv_blocks_shared"] == 0
    for s in samples:  # every sample's cache was right: its logprobs equal a dense teacher-forced recompute
        forced = engine.teacher_forced_logprobs(list(prompt) + s.token_ids.tolist(), len(prompt))
        assert (forced.logprobs - s.logprobs).abs().max().item() < 1e-4


@pytest.mark.parametrize("schedule", [None, SMALL], ids=["dense", "sparse"])
def test_preemption_under_a_tiny_pool_gives_identical_samples(tiny_qwen3, schedule):
    results = {}
    for blocks in (256, 20):
        engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=blocks, prefill_chunk_size=48)
        engine.set_schedule(schedule)
        results[blocks] = engine.generate(requests())
        results[f"{blocks}-preemptions"] = engine.stats()["preemptions"]
        assert engine.scheduler.blocks.num_used == 0
    assert results["256-preemptions"] == 0 and results["20-preemptions"] > 0
    assert_same_samples(results[256], results[20])


def test_chunked_prefill_and_a_small_running_set_change_nothing(tiny_llama):
    reference = NativeEngine.from_pretrained(tiny_llama, num_kv_blocks=256).generate(requests(n=1))
    chunked = NativeEngine.from_pretrained(tiny_llama, num_kv_blocks=256, prefill_chunk_size=16, max_num_seqs=1)
    assert_same_samples(reference, chunked.generate(requests(n=1)))
    assert chunked.stats()["prefill_steps"] > 3 * 3


def test_stream_yields_every_sample_as_it_finishes(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=256)

    async def collect():
        return [s async for s in engine.stream(requests(n=2, max_tokens=(20, 5, 12)))]

    streamed = asyncio.run(collect())
    assert [len(s.token_ids) for s in streamed] == [5, 5, 12, 12, 20, 20]
    generated = engine.generate(requests(n=2, max_tokens=(20, 5, 12)))
    assert_same_samples(sorted(streamed, key=lambda s: (s.request_id, s.sample_index)), generated)


def test_closing_a_stream_early_frees_the_cache(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=256)

    async def first():
        stream = engine.stream(requests(n=2, max_tokens=(20, 5, 12)))
        sample = await anext(stream)
        await stream.aclose()
        return sample

    assert len(asyncio.run(first()).token_ids) == 5
    assert engine.scheduler.blocks.num_used == 0 and not engine.has_unfinished()
