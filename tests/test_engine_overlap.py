"""`overlap_decode`: each decode step is launched before the previous step's tokens are read (they are fed to
it on the device), and the stop rules run while it computes. The samples must be those of the plain loop:
the same tokens, blocks attended and logprobs, the same finish reasons, through stop tokens (a stopped sample's
extra row is discarded), max_tokens, forks, a budget that bites, a pool so small that sequences are preempted,
a schedule hot-update, requests that arrive and an abort while a step is in flight. On CPU the eager step and
the CUDA-graph step body (run without capture) are checked; the captured graphs on a GPU."""

import pytest
import torch

from sparrow.rollout_workers.api import ABORTED, RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine
from sparrow.rollout_workers.native.cuda_graphs import DecodeGraphs
from sparrow.schedule import SparsitySchedule

SMALL = SparsitySchedule(name="small", topk_blocks=(2, 4), edges=(160,))
HOT = SMALL.with_topk((1, 3))
STOPS = tuple(range(100, 400))
"""~15 % of the tiny model's 2048 tokens: sampled sequences stop at one of them every few tokens."""
REQUESTS = [
    RolloutRequest("greedy", tuple(range(3, 110)), SamplingParams(max_tokens=45, temperature=0.0, ignore_eos=True)),
    RolloutRequest("stops", tuple(range(20, 140)),
                   SamplingParams(max_tokens=60, temperature=1.0, seed=3, n=3, stop_token_ids=STOPS, logprobs=5)),
    RolloutRequest("short", tuple(range(40, 90)), SamplingParams(max_tokens=3, temperature=0.8, seed=5, n=2)),
    RolloutRequest("long", tuple(range(200, 330)),
                   SamplingParams(max_tokens=70, temperature=1.0, seed=9, n=2, ignore_eos=True, logprobs=3)),
]


def engine(model_dir, overlap: bool, graphs_on_cpu: bool = False, **config) -> NativeEngine:
    e = NativeEngine.from_pretrained(model_dir, max_num_seqs=8, overlap_decode=overlap, **config)
    if graphs_on_cpu:  # the CUDA-graph step body on the same static buffers, without capture
        r = e.runner
        r.graphs = DecodeGraphs(r.model, r.cache, r.backend, r.layout, 8, r.layout.blocks_for(r.max_model_len))
    return e


def drive(e: NativeEngine, hot_update_at: int | None = None) -> list:
    e.set_schedule(SMALL)
    for request in REQUESTS:
        e.add_request(request)
    samples, steps = [], 0
    while e.has_unfinished():
        samples += e.step()
        steps += 1
        if steps == hot_update_at:
            e.set_schedule(HOT)
    return sorted(samples, key=lambda s: (s.request_id, s.sample_index))


def assert_same(plain: list, overlapped: list, tol: float = 1e-5) -> None:
    assert len(plain) == len(overlapped) == 1 + 3 + 2 + 2
    for a, b in zip(plain, overlapped):
        assert (a.request_id, a.sample_index, a.finish_reason, a.error) == (b.request_id, b.sample_index,
                                                                            b.finish_reason, b.error)
        assert torch.equal(a.token_ids, b.token_ids), a.request_id
        assert torch.equal(a.blocks_attended, b.blocks_attended), a.request_id
        assert a.metadata.get("schedule_versions") == b.metadata.get("schedule_versions")
        assert (a.logprobs - b.logprobs).abs().max().item() <= tol
        assert torch.equal(a.top_ids, b.top_ids)


@pytest.mark.parametrize("num_kv_blocks", [256, 20])  # 20 blocks: sequences are preempted and recomputed
def test_overlapped_decode_gives_the_samples_of_the_plain_loop(tiny_qwen3, num_kv_blocks):
    plain, overlapped = engine(tiny_qwen3, False, num_kv_blocks=num_kv_blocks), engine(
        tiny_qwen3, True, num_kv_blocks=num_kv_blocks)
    expected, got = drive(plain), drive(overlapped)
    assert_same(expected, got)
    reasons = {s.finish_reason for s in got}
    assert reasons == {"stop", "length"}, "stop tokens and max_tokens both end samples"
    stats, base = overlapped.stats(), plain.stats()
    if num_kv_blocks == 256:  # a tight pool reads the step in flight before each preemption and each recompute
        assert stats["decode_steps_overlapped"] > 0.8 * stats["decode_steps"], "most decode steps ran overlapped"
        assert stats["decode_rows_discarded"] > 0, "a sample stopped at a stop token had a row in the next step"
    assert stats["tokens_generated"] == base["tokens_generated"] == sum(len(s.token_ids) for s in got)
    assert stats["decode_tokens"] == base["decode_tokens"]
    if num_kv_blocks == 20:
        assert stats["preemptions"] > 0 and base["preemptions"] > 0
    assert overlapped.stats()["kv_blocks_used"] == 0, "every block went back to the pool"


def test_the_graph_step_fed_on_the_device_with_a_schedule_hot_update(tiny_qwen3):
    """The decode-graph body reading its token ids from the previous step's draws; the hot update lands at
    the same decode step in both loops (every call launches one step)."""
    plain, overlapped = engine(tiny_qwen3, False, num_kv_blocks=256), engine(tiny_qwen3, True, True, num_kv_blocks=256)
    expected, got = drive(plain, hot_update_at=20), drive(overlapped, hot_update_at=20)
    assert_same(expected, got)
    assert {s.metadata.get("schedule_versions") for s in got if s.request_id == "long"} == {"0,1"}
    assert overlapped.stats()["decode_steps_overlapped"] > 0 and overlapped.runner.graphs.num_captured >= 2


def test_requests_that_arrive_and_an_abort_while_a_step_is_in_flight(tiny_qwen3):
    overlapped = engine(tiny_qwen3, True, num_kv_blocks=256)
    overlapped.set_schedule(SMALL)
    first, late = REQUESTS[3], REQUESTS[0]
    overlapped.add_request(first)
    samples = []
    for _ in range(6):
        samples += overlapped.step()
    assert overlapped._inflight is not None, "a decode step is in flight"
    overlapped.add_request(late)  # read the step in flight, prefill the newcomer, go on overlapped
    for _ in range(8):
        samples += overlapped.step()
    overlapped.abort(first.request_id)
    while overlapped.has_unfinished():
        samples += overlapped.step()
    aborted = [s for s in samples if s.request_id == first.request_id]
    assert len(aborted) == 2 and all(s.error == ABORTED for s in aborted)
    (greedy,) = [s for s in samples if s.request_id == late.request_id]
    alone = engine(tiny_qwen3, False, num_kv_blocks=256)
    alone.set_schedule(SMALL)
    (expected,) = alone.generate([late])
    assert torch.equal(greedy.token_ids, expected.token_ids) and greedy.finish_reason == "length"
    assert overlapped.stats()["kv_blocks_used"] == 0 and not overlapped.has_unfinished()


@pytest.mark.gpu
def test_captured_graphs_overlapped_equal_the_plain_eager_loop(tiny_qwen3):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("sparrow.kernels.triton")
    config = dict(device="cuda", dtype="float32", attention_backend="triton", num_kv_blocks=256)
    expected = drive(engine(tiny_qwen3, False, cuda_graphs=False, **config), hot_update_at=20)
    overlapped = engine(tiny_qwen3, True, cuda_graphs=True, **config)
    assert_same(expected, drive(overlapped, hot_update_at=20), 1e-4)
    assert overlapped.stats()["decode_steps_overlapped"] > 0


def test_generate_and_a_stream_closed_early_with_overlap(tiny_qwen3):
    """`generate` returns the plain loop's samples; a stream left while a step is in flight leaves nothing behind."""
    import asyncio

    plain, overlapped = engine(tiny_qwen3, False, num_kv_blocks=256), engine(tiny_qwen3, True, num_kv_blocks=256)
    assert_same(sorted(plain.generate(REQUESTS), key=lambda s: (s.request_id, s.sample_index)),
                sorted(overlapped.generate(REQUESTS), key=lambda s: (s.request_id, s.sample_index)))

    async def first_two():
        got = []
        async for sample in overlapped.stream(REQUESTS):
            got.append(sample)
            if len(got) == 2:
                break
        return got

    assert len(asyncio.run(first_two())) == 2
    assert overlapped._inflight is None and not overlapped.has_unfinished()
    assert overlapped.stats()["kv_blocks_used"] == 0


def test_the_busy_clock_counts_the_host_time_a_step_in_flight_covers(tiny_qwen3):
    """With a step in flight the device works while the caller is away, so the engine's decode clock runs from the
    last step's return: a caller that spends 30 ms between steps sees them on the clock (5 of its 6 pauses come while
    a step is in flight: after the prefill and after the last read none is)."""
    import time

    e = engine(tiny_qwen3, overlap=True)
    e.add_request(RolloutRequest("r", tuple(range(3, 40)), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)))
    start = time.perf_counter()
    while e.has_unfinished():
        e.step()
        time.sleep(0.03)
    wall = time.perf_counter() - start
    stats = e.stats()
    assert stats["decode_steps"] == 5 and stats["decode_tokens"] == 5
    assert 5 * 0.03 <= stats["decode_seconds"] <= wall - stats["prefill_seconds"]
