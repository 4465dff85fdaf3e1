"""The native engine on CUDA: same samples as on CPU (fp32), sparse decode = teacher-forced reference on
the GPU, bf16 runs stay finite, and every available attention backend agrees."""

import pytest
import torch

from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine
from sparrow.schedule import SparsitySchedule

pytestmark = pytest.mark.gpu

SMALL = SparsitySchedule(name="small", topk_blocks=(2, 4), edges=(160,))
REQUESTS = [RolloutRequest(f"r{i}", tuple(range(3 + i, 110 + 7 * i)),
                           SamplingParams(max_tokens=70, temperature=t, seed=i, n=2, ignore_eos=True))
            for i, t in enumerate((0.0, 1.0))]


def run(model_dir, **config):
    engine = NativeEngine.from_pretrained(model_dir, num_kv_blocks=256, **config)
    engine.set_schedule(SMALL)
    return engine, engine.generate(REQUESTS)


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


def test_triton_backend_matches_torch_backend_in_fp32(tiny_qwen3):
    pytest.importorskip("sparrow.kernels.triton")
    engine, triton_samples = run(tiny_qwen3, device="cuda", dtype="float32", attention_backend="triton")
    assert engine.backend.name == "triton"
    _, torch_samples = run(tiny_qwen3, device="cuda", dtype="float32", attention_backend="torch")
    for a, b in zip(triton_samples, torch_samples):
        assert torch.equal(a.blocks_attended, b.blocks_attended)
        assert torch.equal(a.token_ids, b.token_ids)
        assert (a.logprobs - b.logprobs).abs().max().item() < 1e-3


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cuda_bf16_runs_finite_with_each_backend(tiny_qwen3, backend):
    if backend == "triton":
        pytest.importorskip("sparrow.kernels.triton")
    engine, samples = run(tiny_qwen3, device="cuda", dtype="bfloat16", attention_backend=backend)
    assert engine.backend.name == backend
    expected = [s.blocks_attended for s in run(tiny_qwen3)[1]]
    for s, blocks in zip(samples, expected):
        assert s.finish_reason == "length" and torch.isfinite(s.logprobs).all()
        assert torch.equal(s.blocks_attended, blocks)
