"""DistillSparse on the real SmolLM2-135M: a few LoRA steps through the sparse forward raise the 5th
percentile of α (dense vs sparse+LoRA, exact over the full vocabulary) at a small KV budget, while
the dense log-probs stay bit-identical to the adapter-free model.

Runs in a Ray actor so DeepSpeed's process group lives outside the pytest process.
"""

import inspect
import socket
import sys
import textwrap

import pytest
import torch

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow
STEPS = 8
PROMPT, RESPONSE, SEQUENCES = 32, 96, 4
TOPK_BLOCKS = 1  # sink 1 + top-1 + recent 2 = 4 blocks (64 tokens) of up to 128


def _batch(model_dir):
    """Fixed trajectories: teacher-forced real text (Python's textwrap source), advantages 0."""
    from transformers import AutoTokenizer

    from sparrow.trainer import Trajectory, TrajectoryBatch

    ids = AutoTokenizer.from_pretrained(model_dir)(inspect.getsource(textwrap))["input_ids"]
    out = []
    for k in range(SEQUENCES):
        seq = torch.tensor(ids[600 * k : 600 * k + PROMPT + RESPONSE])
        out.append(Trajectory(seq[:PROMPT], seq[PROMPT:], torch.full((RESPONSE,), -1.0), advantage=0.0, group_id=str(k)))
    return TrajectoryBatch(out)


@ray.remote(num_cpus=0)
class DistillRun:
    def run(self, model_dir: str) -> dict:
        from transformers import AutoModelForCausalLM

        from sparrow.schedule import SparsitySchedule
        from sparrow.trainer import TrainerRank
        from sparrow.trainer.forward import PolicyModule, PolicyRunner
        from sparrow.trainer.microbatch import collate, plan_micro_batches

        config = {
            "model": model_dir, "zero_stage": 2, "gradient_checkpointing": False, "micro_batch_tokens": 4096,
            "optimizer": {"lr": 2e-4, "weight_decay": 0.0},  # LoRA: 5 × 2e-4
            "distill_sparse": {"enabled": True, "kl_coef": 1.0, "policy_loss": False, "rank": 8, "alpha": 16},
        }
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        rank = TrainerRank(config, 0, 1)
        rank.setup("127.0.0.1", port)
        rank.set_schedule(SparsitySchedule(name="small", topk_blocks=(TOPK_BLOCKS,) * 20))
        batch = _batch(model_dir)

        dense_before = rank.recompute(batch).logprobs
        plain = PolicyModule(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), 1.0, 20, 2048).eval()
        runner = PolicyRunner(plain, plain, torch.device("cpu"))
        adapter_free = [None] * len(batch)
        with torch.no_grad():
            for plan in plan_micro_batches([t.total_len for t in batch], 4096):
                mb = collate(list(batch), plan, pad_id=0)
                for i, lp in zip(mb.indices, runner.stats(mb).logprobs.split(mb.response_lens)):
                    adapter_free[i] = lp

        alpha_before = rank.measure_sparse_alpha(batch).combined()[0]
        metrics = [rank.distill_step(batch, dense_before) for _ in range(STEPS)]
        alpha_after = rank.measure_sparse_alpha(batch).combined()[0]
        dense_after = rank.recompute(batch).logprobs
        return {
            "p5": (float(alpha_before.percentile(5.0)[0]), float(alpha_after.percentile(5.0)[0])),
            "mean": (float(alpha_before.mean()[0]), float(alpha_after.mean()[0])),
            "tokens": int(alpha_after.count().sum()),
            "metrics": metrics,
            "dense_equal_after": all(torch.equal(a, b) for a, b in zip(dense_before, dense_after)),
            "dense_equal_adapter_free": all(torch.equal(a, b) for a, b in zip(dense_before, adapter_free)),
        }


def test_distill_sparse_raises_tail_alpha_and_keeps_dense_identical(smollm2):
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the worker cannot import this test module
    try:
        out = ray.get(DistillRun.remote().run.remote(str(smollm2)))
    finally:
        ray.shutdown()
    before, after = out["p5"]
    assert out["tokens"] == SEQUENCES * RESPONSE
    assert before < 0.9  # the budget really bites
    assert after >= before + 0.01, out["p5"]
    first, last = out["metrics"][0], out["metrics"][-1]
    assert last["distill/abs_log_ratio_mean"] < first["distill/abs_log_ratio_mean"]
    assert out["dense_equal_after"] and out["dense_equal_adapter_free"]
