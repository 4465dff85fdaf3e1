"""Requests fed to a running stream (`RequestFeed`) and `abort`, on the native engine: fed requests give the
samples one generate call gives, an abort frees its blocks and never passes partial samples off as finished,
and a closed feed ends the stream."""

import asyncio
import threading
import time

import torch

from sparrow.rollout_workers.api import ABORTED, RequestFeed, RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine
from sparrow.schedule import SparsitySchedule

SMALL = SparsitySchedule(name="small", topk_blocks=(2,), edges=())  # 5 blocks


def requests(max_tokens=(40, 25, 33, 18), prompt_lens=(67, 40, 90, 21), n=2):
    return [RolloutRequest(f"r{i}", tuple(range(3 + i, 3 + i + p)),
                           SamplingParams(max_tokens=m, temperature=1.0, seed=10 + i, n=n, ignore_eos=True))
            for i, (p, m) in enumerate(zip(prompt_lens, max_tokens))]


def by_id(samples):
    return sorted(samples, key=lambda s: (s.request_id, s.sample_index))


def assert_same_samples(a, b, atol=1e-5):
    assert [(s.request_id, s.sample_index) for s in a] == [(s.request_id, s.sample_index) for s in b]
    for x, y in zip(a, b):
        assert x.finish_reason == y.finish_reason and x.error == y.error
        assert torch.equal(x.token_ids, y.token_ids)
        assert torch.equal(x.blocks_attended, y.blocks_attended)
        assert (x.logprobs - y.logprobs).abs().max().item() < atol


def consume(engine, feed, on_sample=lambda sample, seen: None):
    """Run `engine.stream(feed)` to its end on this thread; `on_sample` sees every sample as it arrives."""

    async def run():
        seen = []
        async for sample in engine.stream(feed):
            seen.append(sample)
            on_sample(sample, seen)
        return seen

    return asyncio.run(run())


def when(condition, action, timeout_s=600.0):
    """Run `action` on another thread once `condition()` holds (or `timeout_s` has passed)."""

    def wait_then_act():
        deadline = time.monotonic() + timeout_s
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.005)
        action()

    thread = threading.Thread(target=wait_then_act, daemon=True)
    thread.start()
    return thread


def test_requests_fed_mid_stream_give_the_samples_of_one_generate_call(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=256, max_num_seqs=4)
    engine.set_schedule(SMALL)
    reqs = requests()
    expected = engine.generate(reqs)
    feed = RequestFeed(reqs[:1])

    def feed_the_rest():
        feed.put(reqs[1])
        when(lambda: engine.counters().tokens_generated >= base + 30, lambda: (feed.put(reqs[2]), feed.put(reqs[3]), feed.close()))

    base, prefills = engine.counters().tokens_generated, engine.stats()["prefill_steps"]
    producer = when(lambda: engine.counters().tokens_generated >= base + 5, feed_the_rest)
    streamed = consume(engine, feed)
    producer.join()
    assert engine.stats()["prefill_steps"] - prefills >= 3  # r1, then r2 and r3, were admitted while others decoded
    assert_same_samples(by_id(streamed), by_id(expected))
    assert engine.scheduler.blocks.num_used == 0 and engine.counters().samples_running == 0


def test_abort_fails_the_unfinished_samples_and_frees_their_blocks(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=256)
    long, short = requests(max_tokens=(200, 12), prompt_lens=(40, 21))
    engine.add_request(long)
    engine.add_request(short)
    for _ in range(4):
        engine.step()
    used = engine.scheduler.blocks.num_used
    engine.abort("r0")
    aborted = engine.step()
    assert [(s.request_id, s.sample_index, s.finish_reason, s.error) for s in aborted] == [
        ("r0", 0, "error", ABORTED), ("r0", 1, "error", ABORTED)]
    assert all(s.token_ids.numel() == 0 and s.logprobs.numel() == 0 for s in aborted)  # no partial sample
    assert engine.scheduler.blocks.num_used < used and not engine.scheduler.unfinished("r0")
    rest = []
    while engine.has_unfinished():
        rest += engine.step()
    assert [(s.request_id, s.finish_reason, len(s.token_ids)) for s in rest] == [("r1", "length", 12)] * 2
    assert engine.scheduler.blocks.num_used == 0
    engine.abort("r1")  # finished: nothing to abort
    assert engine.step() == []


def test_abort_while_streaming_from_another_thread(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=256)
    reqs = requests(max_tokens=(200, 10, 30), prompt_lens=(40, 21, 30))
    expected = {(s.request_id, s.sample_index): s for s in engine.generate(reqs[1:])}
    feed = RequestFeed(reqs[:2])
    when(lambda: engine.counters().samples_finished >= 2, lambda: (
        engine.abort("r0"), feed.put(reqs[2]), engine.abort("r2"), feed.close()))
    streamed = {(s.request_id, s.sample_index): s for s in consume(engine, feed)}
    assert sorted(streamed) == [("r0", 0), ("r0", 1), ("r1", 0), ("r1", 1), ("r2", 0), ("r2", 1)]
    for request_id in ("r0", "r2"):  # r2 was aborted before the loop took it from the feed, or right after
        for index in (0, 1):
            sample = streamed[(request_id, index)]
            assert (sample.finish_reason, sample.error, sample.token_ids.numel()) == ("error", ABORTED, 0)
    assert_same_samples([streamed[("r1", 0)], streamed[("r1", 1)]], [expected[("r1", 0)], expected[("r1", 1)]])
    assert engine.scheduler.blocks.num_used == 0 and engine.counters().samples_running == 0


def test_closing_an_empty_feed_ends_the_stream(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=32)
    closed = RequestFeed()
    closed.close()
    assert consume(engine, closed) == []
    feed = RequestFeed()
    when(lambda: True, feed.close)  # the stream waits on the empty feed until another thread closes it
    assert consume(engine, feed) == []


def test_a_schedule_set_from_another_thread_takes_effect_between_steps(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=256)
    request = RolloutRequest("hot", tuple(range(3, 60)), SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    switched = SMALL.with_topk((2,), version=5)
    when(lambda: engine.counters().tokens_generated >= 20, lambda: engine.set_schedule(switched))
    (sample,) = consume(engine, RequestFeed.of([request]))
    assert sample.metadata["schedule_versions"] == "-1,5" and engine.schedule is switched
    context = (len(request.prompt_token_ids) + torch.arange(60) + 15) // 16
    assert (sample.blocks_attended < context).any() and torch.equal(sample.blocks_attended[:20], context[:20].int())
