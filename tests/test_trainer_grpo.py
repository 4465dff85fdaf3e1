"""A short GRPO run end to end: the native engine samples, the trainer (a Ray actor) updates, weights
go back through the object store; the mean reward on a fixed seed set rises."""

import pytest
import torch

ray = pytest.importorskip("ray")

from sparrow.rollout_workers.api import RolloutRequest, SamplingParams  # noqa: E402
from sparrow.rollout_workers.native import NativeEngine  # noqa: E402
from sparrow.trainer import TrajectoryBatch  # noqa: E402
from sparrow.weight_sync import HandleSource, WeightReceiver  # noqa: E402

pytestmark = pytest.mark.slow
TARGET = 1024  # reward: share of response tokens with id < TARGET (half the vocabulary; 0.5 for a random model)
STEPS = 20


def _requests(prompts, seed):
    params = lambda i: SamplingParams(max_tokens=2, temperature=1.0, ignore_eos=True, n=8, seed=seed + i, logprobs=5)  # noqa: E731
    return [RolloutRequest(f"p{i}", p, params(i)) for i, p in enumerate(prompts)]


def _reward(sample) -> float:
    return float((sample.token_ids < TARGET).float().mean())


def test_grpo_raises_mean_reward(tiny_qwen3):
    from sparrow.trainer.group import TrainerGroup

    g = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(3, 2000, (6,), generator=g).tolist()) for _ in range(8)]
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=128, max_num_seqs=64)
    evaluate = lambda: sum(map(_reward, s := engine.generate(_requests(prompts, 10_000)))) / len(s)  # noqa: E731
    before = evaluate()
    receiver = WeightReceiver(engine)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        config = {"model": str(tiny_qwen3), "optimizer": {"lr": 1e-2, "weight_decay": 0.0}, "recompute_topk": 5}
        group = TrainerGroup(config, 1, actor_options={"num_cpus": 0})
        history = []
        for step in range(1, STEPS + 1):
            samples = engine.generate(_requests(prompts, 100 * step))
            batch = TrajectoryBatch.from_rollout_samples(samples, [_reward(s) for s in samples])
            result = group.train_step(batch)
            receiver.receive(HandleSource(group.publish_weights(step, "object_store").handle))
            history.append(result)
        group.shutdown()
    finally:
        ray.shutdown()
    after = evaluate()
    assert engine.policy_version == STEPS
    assert after >= before + 0.2, (before, after)
    first = history[0]
    # dense rollouts from the native engine and the trainer's recompute agree to float noise
    assert max(r.metrics["train/abs_log_ratio_max"] for r in history) < 1e-4
    assert set(first.alpha.lower) == {-1} and first.alpha.tokens() == first.metrics["train/loss_tokens"] == 128
    assert history[-1].metrics["train/entropy"] < first.metrics["train/entropy"]
