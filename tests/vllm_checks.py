"""What the vLLM tests share: random prompts, greedy requests, a run under a schedule, the schedule hot-update
check, and the names of `_vllm.__all__` the installed (or PYTHONPATH-given) vLLM lacks."""

import time
from concurrent.futures import ThreadPoolExecutor

import torch

from sparrow.layout import DEFAULT_LAYOUT
from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.schedule import SparsitySchedule

SMALL = SparsitySchedule(name="small", topk_blocks=(2, 4), edges=(160,))  # 5 blocks, 7 beyond 160 tokens


def random_prompts(lengths, seed=0, vocab=2000):
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(3, vocab, (n,), generator=g).tolist()) for n in lengths]


def greedy_requests(prompts, max_tokens=40, logprobs=20):
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=logprobs, ignore_eos=True)
    return [RolloutRequest(f"p{i}", p, sp) for i, p in enumerate(prompts)]


def run(engine, schedule, requests):
    engine.set_schedule(schedule)
    return engine.generate(requests)


def check_hot_update(engine, switch_after: int) -> int:
    """Dense, then SMALL as version 7 once `switch_after` tokens of a 500-token greedy generation are out: the
    very next decode step attends the new budget, and the worker's own per-step trace of the kernels (the engine
    needs `trace_steps`) equals the per-token record. Returns the token the switch took effect at."""
    new = SMALL.with_topk((2, 4), version=7)
    prompt = random_prompts((200,), seed=3)[0]
    sampling = SamplingParams(max_tokens=500, temperature=0.0, logprobs=5, ignore_eos=True)
    request = RolloutRequest("hot", prompt, sampling)
    engine.set_schedule(None)
    start = engine.stats()["tokens_generated"]
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(engine.generate, [request])
        while engine.stats()["tokens_generated"] - start < switch_after and not future.done():
            time.sleep(0.01)
        engine.set_schedule(new)
        (sample,) = future.result()
    assert sample.metadata["schedule_versions"] == "-1,7" and sample.schedule_version == 7
    lengths = len(prompt) + torch.arange(500)
    dense = (lengths + 15) // 16
    switch = int((sample.blocks_attended < dense).int().argmax())
    assert switch_after <= switch < 500
    assert torch.equal(sample.blocks_attended[:switch], dense[:switch].int())
    budgets = torch.minimum(dense[switch:], new.budgets_for_lengths(lengths[switch:]))
    assert torch.equal(sample.blocks_attended[switch:].long(), budgets.long())
    end = len(prompt) + 500
    steps = [s for s in engine.trace() if len(s["seq_lens"]) == 1 and len(prompt) < s["seq_lens"][0] <= end][-499:]
    assert [s["seq_lens"][0] - len(prompt) for s in steps] == list(range(1, 500))
    reserved = DEFAULT_LAYOUT.sink + DEFAULT_LAYOUT.recent
    for s in steps:
        t = s["seq_lens"][0] - len(prompt)
        assert s["blocks_attended"][0] == sample.blocks_attended[t].item()
        assert s["schedule_version"] == (7 if t >= switch else -1)
        if t < switch:
            assert s["chosen"] == {}, "a dense step chooses nothing"
            continue
        assert len(s["chosen"]) == len(s["margin"]) > 0, "every sparse layer traces its choice"
        for layer, (row,) in s["chosen"].items():
            assert all(len(head) == s["blocks_attended"][0] - reserved for head in row), (t, layer, row)
            assert s["margin"][layer][0] >= 0
    return switch


def unresolved_names() -> list[str]:
    """Every name the plugin takes from vLLM that this vLLM does not have, with the reason."""
    from sparrow.rollout_workers.vllm_backend import _vllm

    missing = []
    for name in _vllm.__all__:
        try:
            getattr(_vllm, name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name}: {exc}")
    return missing
