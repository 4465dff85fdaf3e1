"""Numerical guards (issue 12): a non-finite gradient skips the optimizer update and is counted (DeepSpeed's
overflow check, every ZeRO stage, fp32 included); NaN/Inf weights are never published: the job rolls the
trainer back to its last checkpoint, redoes the step, and the rollout workers keep serving finite weights.
Non-finite samples never reach the trainer (the wire validation: tests/test_grpc_messages.py)."""

import math
import os
import sys
from collections import Counter

import pytest
import torch

ray = pytest.importorskip("ray")

sys.path.insert(0, os.path.dirname(__file__))

from jobs import tiny_job  # noqa: E402
from test_reliability import _logical  # noqa: E402
from test_trainer_distributed import _batch  # noqa: E402

from sparrow.coordinator.config import load_config  # noqa: E402
from sparrow.coordinator.driver import TrainingJob  # noqa: E402
from sparrow.coordinator.run_dir import RunDir  # noqa: E402
from sparrow.coordinator.step_record import StepRecord  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors run this file's helpers
    yield
    ray.shutdown()


def _weights_finite(rank) -> bool:
    return all(bool(torch.isfinite(p.ds_tensor if hasattr(p, "ds_tensor") else p.data).all())
               for p in rank.engine.module.parameters())


def _poison(rank) -> None:
    """One NaN in the first parameter: what a diverged update or a bad host would leave behind."""
    with torch.no_grad():
        p = next(rank.engine.module.parameters())
        (p.ds_tensor if hasattr(p, "ds_tensor") else p.data).view(-1)[0] = math.nan


def _nan_gradients(rank):
    """A backward hook that turns the first parameter's gradient into NaN (a non-finite loss does the same)."""
    return next(rank.engine.module.parameters()).register_hook(lambda g: g * math.nan)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_non_finite_gradient_skips_the_update_and_counts_it(ray_cluster, tiny_qwen3, stage):
    from sparrow.trainer.rank import TrainerRank

    actor = ray.remote(TrainerRank).options(num_cpus=0).remote(
        {"model": str(tiny_qwen3), "zero_stage": stage, "optimizer": {"lr": 1e-3}}, 0, 1)
    try:
        ray.get(actor.setup.remote("127.0.0.1", 29700 + stage))
        digest = lambda: ray.get(actor.__ray_call__.remote(  # noqa: E731
            lambda r: sum(float((p.ds_tensor if hasattr(p, "ds_tensor") else p.data).double().sum())
                          for p in r.engine.module.parameters())))
        before = digest()
        ray.get(actor.__ray_call__.remote(lambda r: setattr(r, "_hook", _nan_gradients(r))))
        skipped = ray.get(actor.train_step.remote(_batch()))
        ray.get(actor.__ray_call__.remote(lambda r: r._hook.remove()))
        assert skipped.metrics["train/skipped_updates"] == 1.0
        assert digest() == before, "a skipped update leaves every weight as it was"
        assert ray.get(actor.__ray_call__.remote(_weights_finite))
        normal = ray.get(actor.train_step.remote(_batch()))
        assert normal.metrics["train/skipped_updates"] == 0.0 and digest() != before
    finally:
        ray.kill(actor)


def test_nan_weights_are_never_published_and_the_trainer_rolls_back(ray_cluster, tiny_qwen3, tmp_path):
    path = tiny_job(tmp_path / "job.yaml", tiny_qwen3, tmp_path / "runs", {
        "rollout.native": {"max_num_seqs": 8, "max_model_len": 256, "num_kv_blocks": 256}, "run.checkpoint_every": 1,
    })
    config = load_config(path, ["run.name=nan"])
    run_dir = RunDir.create(config.run.out_dir, "nan")
    logged = []
    with TrainingJob(config, run_dir, progress=False, log=logged.append) as job:
        job.run(steps=1)
        ray.get(job.trainers.actors[0].__ray_call__.remote(_poison))
        job.run(steps=2)
        trained = Counter(_logical(i) for rank in job.trained_ids() for i in rank)
        assert ray.get(job.trainers.actors[0].__ray_call__.remote(_weights_finite))
        served = ray.get([a.__ray_call__.remote(lambda w: w.engine.policy_version) for a in job.fleet.actors])
    expected = {f"s{k}-p{i}#{j}" for k in range(3) for i in range(3) for j in range(2)}
    assert set(trained) == expected and set(trained.values()) == {1}, "0 lost, 0 duplicated"
    records = [StepRecord.from_dict(r) for r in RunDir.read_jsonl(run_dir.metrics_file)]
    refused = [e for r in records for e in r.faults if e.kind == "publish_refused"]
    assert len(refused) == 1 and "NaN/Inf" in refused[0].detail, [r.faults for r in records]
    assert [r.step for r in records] == [0, 1, 2]
    assert served == [3], "the worker serves the last finite version"
    print("\n".join(logged))
    assert any("refused" in line or "NaN" in line for line in logged), logged
