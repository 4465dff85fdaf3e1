"""The native engine on CUDA: same samples as on CPU (fp32), sparse decode = teacher-forced reference on
the GPU, bf16 runs stay finite, every available attention backend agrees, and CUDA-graph replay equals
eager decoding (budgets changing across bins, a schedule hot-update, preemption). The graphs'
bookkeeping (row slots, device block tables, padding rows, device budgets) is also checked on CPU,
where the same static-buffer step runs without capture."""

import pytest
import torch

from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine
from sparrow.rollout_workers.native.cuda_graphs import DecodeGraphs, batch_buckets, width_bucket
from sparrow.schedule import SparsitySchedule

gpu = pytest.mark.gpu

SMALL = SparsitySchedule(name="small", topk_blocks=(2, 4), edges=(160,))
REQUESTS = [RolloutRequest(f"r{i}", tuple(range(3 + i, 110 + 7 * i)),
                           SamplingParams(max_tokens=70, temperature=t, seed=i, n=2, ignore_eos=True))
            for i, t in enumerate((0.0, 1.0))]


def run(model_dir, **config):
    engine = NativeEngine.from_pretrained(model_dir, num_kv_blocks=256, **config)
    engine.set_schedule(SMALL)
    return engine, engine.generate(REQUESTS)


@gpu
def test_cuda_fp32_matches_cpu_and_the_teacher_forced_reference(tiny_qwen3):
    _, cpu = run(tiny_qwen3)
    engine, gpu = run(tiny_qwen3, device="cuda", dtype="float32", attention_backend="torch")
    for a, b in zip(cpu, gpu):
        assert torch.equal(a.blocks_attended, b.blocks_attended)
        if a.sample_index == 0 and a.request_id == "r0":  # greedy: identical tokens
            assert torch.equal(a.token_ids, b.token_ids)
    for s in gpu:
        tokens = list(s.prompt_token_ids) + s.token_ids.tolist()
        forced = engine.teacher_forced_logprobs(tokens, len(s.prompt_token_ids), SMALL)
        assert (forced.logprobs.cpu() - s.logprobs).abs().max().item() < 1e-3


@gpu
def test_triton_backend_matches_torch_backend_in_fp32(tiny_qwen3):
    pytest.importorskip("sparrow.kernels.triton")
    engine, triton_samples = run(tiny_qwen3, device="cuda", dtype="float32", attention_backend="triton")
    assert engine.runner.backend.name == "triton"
    _, torch_samples = run(tiny_qwen3, device="cuda", dtype="float32", attention_backend="torch")
    for a, b in zip(triton_samples, torch_samples):
        assert torch.equal(a.blocks_attended, b.blocks_attended)
        assert torch.equal(a.token_ids, b.token_ids)
        assert (a.logprobs - b.logprobs).abs().max().item() < 1e-3


@gpu
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_bf16_runs_finite_with_each_backend(tiny_qwen3, backend):
    if backend == "triton":
        pytest.importorskip("sparrow.kernels.triton")
    engine, samples = run(tiny_qwen3, device="cuda", dtype="bfloat16", attention_backend=backend)
    assert engine.runner.backend.name == backend
    expected = [s.blocks_attended for s in run(tiny_qwen3)[1]]
    for s, blocks in zip(samples, expected):
        assert s.finish_reason == "length" and torch.isfinite(s.logprobs).all()
        assert torch.equal(s.blocks_attended, blocks)


# ------------------------------------------------------------------------------------ decode graphs

BINNED = SparsitySchedule(name="binned", topk_blocks=(2, 4, 3, 6), edges=(140, 170, 200))
HOT = BINNED.with_topk((1, 3, 5, 2))  # hot-update: new budgets in every bin, version 1
MIXED = [RolloutRequest(f"m{i}", tuple(range(3 + i, 110 + 9 * i)),
                        SamplingParams(max_tokens=60 + 13 * i, temperature=t, seed=i, n=n, ignore_eos=True, logprobs=5))
         for i, (t, n) in enumerate([(0.0, 1), (1.0, 3), (0.7, 2)])]


def drive(engine, hot_update_at: int = 25):
    """Step the engine by hand so the schedule changes mid-generation at the same step for every engine."""
    engine.set_schedule(BINNED)
    for request in MIXED:
        engine.add_request(request)
    samples, steps = [], 0
    while engine.has_unfinished():
        samples += engine.step()
        steps += 1
        if steps == hot_update_at:
            engine.set_schedule(HOT)
    return sorted(samples, key=lambda s: (s.request_id, s.sample_index))


def assert_same_samples(eager, static, logprob_tol):
    assert len(eager) == len(static) == 6
    for a, b in zip(eager, static):
        assert (a.request_id, a.sample_index, a.finish_reason) == (b.request_id, b.sample_index, "length")
        assert torch.equal(a.token_ids, b.token_ids)
        assert torch.equal(a.blocks_attended, b.blocks_attended)
        assert a.metadata.get("schedule_versions") == b.metadata.get("schedule_versions") == "0,1"
        assert (a.logprobs - b.logprobs).abs().max().item() <= logprob_tol
        assert torch.equal(a.top_ids, b.top_ids) or (a.top_logprobs - b.top_logprobs).abs().max().item() <= logprob_tol


def test_buckets():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(6) == [1, 2, 4, 6] and batch_buckets(1) == [1]
    assert [width_bucket(n, 2064) for n in (1, 16, 17, 300, 2049, 2064)] == [16, 16, 32, 512, 2064, 2064]


@pytest.mark.parametrize("num_kv_blocks,kv_cache_dtype,tolerance", [(256, "auto", 1e-5), (30, "auto", 1e-5),
                                                                     (256, "fp8_e4m3", 1e-3)])
def test_static_decode_step_equals_eager_on_cpu(tiny_qwen3, num_kv_blocks, kv_cache_dtype, tolerance):
    """The graphs' step body, run eagerly on CPU, against the eager engine: same tokens, blocks, logprobs (30 blocks:
    sequences are preempted and recomputed; FP8 pages: their scales are static buffers too). The static step's
    padded batch takes other BLAS kernels, so a key may differ in its last float32 bit; on an e4m3 rounding boundary
    that becomes one FP8 step, which some CPUs show (6e-5 in log-prob on a 2026-12 Xeon, 0 on others)."""
    config = dict(num_kv_blocks=num_kv_blocks, max_num_seqs=6, kv_cache_dtype=kv_cache_dtype)
    eager = NativeEngine.from_pretrained(tiny_qwen3, **config)
    static = NativeEngine.from_pretrained(tiny_qwen3, **config)
    runner = static.runner
    runner.graphs = DecodeGraphs(runner.model, runner.cache, runner.backend, runner.layout, 6,
                                 runner.layout.blocks_for(runner.max_model_len))
    assert_same_samples(drive(eager), drive(static), tolerance)
    assert runner.graphs.num_captured >= 2  # batch buckets 6 and 2 (sequences finish at different lengths)
    if num_kv_blocks == 30:
        assert static.stats()["preemptions"] > 0


@gpu
@pytest.mark.parametrize("num_kv_blocks", [256, 30])
def test_graph_replay_equals_eager_across_bins_and_a_hot_update(tiny_qwen3, num_kv_blocks):
    pytest.importorskip("sparrow.kernels.triton")
    config = dict(device="cuda", dtype="float32", attention_backend="triton", num_kv_blocks=num_kv_blocks, max_num_seqs=6)
    graphs = NativeEngine.from_pretrained(tiny_qwen3, cuda_graphs=True, **config)
    eager = NativeEngine.from_pretrained(tiny_qwen3, cuda_graphs=False, **config)
    assert_same_samples(drive(eager), drive(graphs), 1e-4)
    stats = graphs.stats()
    assert stats["cuda_graphs"] and stats["cuda_graphs_captured"] >= 2 and not eager.stats()["cuda_graphs"]


@gpu
def test_fp8_kv_graph_replay_equals_the_torch_backend(tiny_qwen3):
    """FP8 pages on CUDA: the Triton kernels under CUDA graphs decode what the torch backend decodes eagerly: the
    same tokens and blocks, and the same log-probs except where FP8 amplifies float32's last bits. The two backends'
    keys differ in their last bits (fused vs plain kernels; < 1e-3 in log-prob without FP8), and an element on an
    e4m3 rounding boundary then lands one step (1/16–1/8 of its size) apart: measured on an H100, max 0.148."""
    pytest.importorskip("sparrow.kernels.triton")
    config = dict(device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=6, kv_cache_dtype="fp8_e4m3")
    graphs = NativeEngine.from_pretrained(tiny_qwen3, attention_backend="triton", cuda_graphs=True, **config)
    eager = NativeEngine.from_pretrained(tiny_qwen3, attention_backend="torch", **config)
    eager_samples, graph_samples = drive(eager), drive(graphs)
    assert_same_samples(eager_samples, graph_samples, 0.25)
    gaps = torch.cat([(a.logprobs - b.logprobs).abs() for a, b in zip(eager_samples, graph_samples)])
    assert gaps.median().item() <= 1e-3, f"median log-prob gap {gaps.median().item():.2e}: more than boundary flips"
    assert graphs.stats()["cuda_graphs_captured"] >= 2


@gpu
def test_int8_landmarks_graph_replay_equals_the_torch_backend(tiny_qwen3):
    """`landmark=mean_int8` on CUDA: the Triton write (int8 rows + float32 scale) and scoring under CUDA graphs pick
    the blocks the torch backend picks eagerly, and decode the same tokens."""
    pytest.importorskip("sparrow.kernels.triton")
    config = dict(device="cuda", dtype="float32", num_kv_blocks=256, max_num_seqs=6, landmark="mean_int8")
    graphs = NativeEngine.from_pretrained(tiny_qwen3, attention_backend="triton", cuda_graphs=True, **config)
    eager = NativeEngine.from_pretrained(tiny_qwen3, attention_backend="torch", **config)
    assert graphs.runner.cache.landmarks.dtype == torch.int8
    assert_same_samples(drive(eager), drive(graphs), 1e-3)
    assert graphs.stats()["cuda_graphs_captured"] >= 2


@gpu
def test_cuda_graphs_need_the_triton_backend(tiny_qwen3):
    with pytest.raises(ValueError, match="cuda_graphs=True needs"):
        NativeEngine.from_pretrained(tiny_qwen3, device="cuda", attention_backend="torch", cuda_graphs=True)
    assert not NativeEngine.from_pretrained(tiny_qwen3, device="cuda", attention_backend="torch").stats()["cuda_graphs"]


def test_cuda_graphs_refused_on_cpu(tiny_qwen3):
    with pytest.raises(ValueError, match="cuda_graphs=True needs device='cuda'"):
        NativeEngine.from_pretrained(tiny_qwen3, cuda_graphs=True)


@gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_fused_model_equals_unfused_on_cuda(dtype, tol):
    """Shared q/k/v and gate/up weights + fused q/k norm-RoPE and SiLU kernels vs the plain module (head_dim 128)."""
    import dataclasses

    from sparrow.kernels import SparseAttentionConfig
    from sparrow.rollout_workers.native import DecoderModel
    from sparrow.rollout_workers.native.attention import TeacherForced
    from sparrow.rollout_workers.native.shapes import spec_for_shape

    spec = dataclasses.replace(spec_for_shape("qwen3-1.7b"), num_layers=3, vocab_size=4096)
    plain = DecoderModel(spec, 512, device="cuda", dtype=dtype, fuse=False).init_random(5)
    fused = DecoderModel(spec, 512, device="cuda", dtype=dtype)
    assert fused.fused
    with torch.no_grad():
        for name, p in fused.named_parameters():
            p.copy_(dict(plain.named_parameters())[name])
    ids, pos = torch.randint(0, spec.vocab_size, (300,), device="cuda"), torch.arange(300, device="cuda")
    attention = TeacherForced(SparseAttentionConfig(), None)
    got, expect = fused.logits(fused(ids, pos, attention)), plain.logits(plain(ids, pos, attention))
    assert ((got - expect).norm() / expect.norm()).item() <= tol
