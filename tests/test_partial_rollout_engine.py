"""Interrupting a sample and resuming it (partial rollouts, `sparrow.rollout_workers.resume`): the native engine
hands back the tokens it generated, and the joined sample equals an uninterrupted one under the same weights."""

import torch

from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine
from sparrow.rollout_workers.resume import join, resume_request, tokens_by_version

GREEDY = SamplingParams(max_tokens=20, temperature=1e-5, n=2, seed=3, ignore_eos=True, logprobs=4)


def _request(rid="g") -> RolloutRequest:
    return RolloutRequest(rid, tuple(range(5, 37)), GREEDY, metadata={"step": "0"})


def test_an_interrupted_sample_resumed_under_the_same_weights_equals_an_uninterrupted_one(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=32)
    whole = engine.generate([_request()])
    request = _request()
    engine.add_request(request)
    for _ in range(8):
        assert engine.step() == []
    engine.interrupt("g")
    engine.interrupt("unknown")  # ignored
    parts = engine.step()
    assert sorted(p.sample_index for p in parts) == [0, 1] and {p.finish_reason for p in parts} == {"interrupted"}
    cut = [int(p.token_ids.numel()) for p in parts]
    assert all(0 < c < 20 for c in cut) and not engine.has_unfinished()
    assert engine.counters().samples_running == 0, "an interrupted sample frees its slot and blocks"
    engine.load_weights({n: p.detach().clone() for n, p in engine.runner.model.named_parameters()}, 1)
    for part in sorted(parts, key=lambda p: p.sample_index):
        again = resume_request(request, part.sample_index, [part])
        assert again.sampling.max_tokens == 20 - int(part.token_ids.numel()) and again.sampling.n == 1
        assert again.prompt_token_ids == request.prompt_token_ids + tuple(part.token_ids.tolist())
        rest = engine.generate([again])[0]
        joined = join(request, part.sample_index, [part, rest])
        ref = whole[part.sample_index]
        assert joined.request_id == "g" and joined.prompt_token_ids == list(request.prompt_token_ids)
        assert joined.token_ids.tolist() == ref.token_ids.tolist(), "greedy: the same tokens across the cut"
        torch.testing.assert_close(joined.logprobs, ref.logprobs, atol=1e-4, rtol=0)
        assert joined.top_ids.shape == ref.top_ids.shape and joined.blocks_attended.shape == ref.blocks_attended.shape
        assert joined.policy_version == 0 and joined.finish_reason == "length"
        assert joined.metadata["policy_versions"] == f"0:0,{part.token_ids.numel()}:1"
    engine.shutdown()


def test_a_request_interrupted_before_its_first_token_comes_back_empty_and_resumes_whole(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=32)
    request = _request("early")
    engine.add_request(request)
    engine.interrupt("early")
    parts = engine.step()
    assert [p.token_ids.numel() for p in parts] == [0, 0] and {p.finish_reason for p in parts} == {"interrupted"}
    rest = engine.generate([resume_request(request, 1, [parts[1]])])[0]
    joined = join(request, 1, [parts[1], rest])
    assert joined.token_ids.numel() == 20 and "policy_versions" not in joined.metadata
    engine.shutdown()


def _part(tokens: int, version: int, finish: str = "interrupted"):
    from sparrow.rollout_workers.api import RolloutSample

    return RolloutSample("g", 0, list(range(5, 37)), torch.arange(tokens), torch.zeros(tokens), torch.zeros(tokens, 1, dtype=torch.long),
                         torch.zeros(tokens, 1), torch.ones(tokens, dtype=torch.int32), finish, version, 0)


def test_a_joined_sample_counts_its_tokens_by_the_policy_that_sampled_them():
    """What the step record's stale_tokens adds up: 120 tokens of version 3, then 45 of version 4 (two parts)."""
    joined = join(_request(), 0, [_part(120, 3), _part(30, 4), _part(15, 4, finish="stop")])
    assert joined.metadata["policy_versions"] == "0:3,120:4" and joined.policy_version == 3
    assert tokens_by_version(joined) == {3: 120, 4: 45}
    assert tokens_by_version(_part(50, 2, finish="stop")) == {2: 50}, "one version: all of its tokens"
    assert tokens_by_version(_part(0, 2, finish="stop")) == {}
