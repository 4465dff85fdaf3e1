"""Partial rollouts in the real job (Ray, gRPC, DeepSpeed, the tiny model): a step trains the first groups to
finish, the others carry over, are interrupted at the weight change and resume under the new policy; every
dispatched sample is trained once or is still in flight at the end, also with a worker killed while it holds a
carried-over group."""

import threading
import time
from collections import Counter

import pytest
import ray
from jobs import tiny_job

from sparrow.coordinator.config import load_config
from sparrow.coordinator.driver import TrainingJob
from sparrow.coordinator.run_dir import RunDir
from sparrow.coordinator.step_record import StepRecord

pytestmark = pytest.mark.slow

STEPS, PROMPTS, EXTRA, N = 4, 3, 2, 2


def _config(tmp_path, model, name: str, workers: int, settings: dict | None = None):
    path = tiny_job(tmp_path / f"{name}.yaml", model, tmp_path / "runs", {
        "rollout.pool": {"size": workers, "cpus": 0.5},
        "rollout.native": {"max_num_seqs": 4, "max_model_len": 256, "num_kv_blocks": 256},  # 2 groups at a time
        "rollout.sampling.max_tokens": 48,
        "run.steps": STEPS, "run.prompts_per_step": PROMPTS, "run.checkpoint_every": 0,
        "run.partial_rollout": {"enabled": True, "extra_groups": EXTRA, "max_staleness": 2},
        "run.recovery": {"lease_timeout_s": 8, "hung_worker_timeout_s": 5},
    } | (settings or {}))
    return load_config(path, [f"run.name={name}"])


def _logical(sample_id: str) -> str:
    return sample_id.split(".r")[0] + "#" + sample_id.rsplit("#", 1)[1] if ".r" in sample_id else sample_id


def _check(job: TrainingJob, records: list[StepRecord], extra: int = EXTRA) -> Counter:
    dispatched = {f"{r.prompt_id}#{j}" for k in range(STEPS) for r in job.data.batch(k, PROMPTS) for j in range(N)}
    dispatched |= {f"{r.prompt_id}#{j}" for r in job.data.spares(0, extra) for j in range(N)}
    trained = Counter(_logical(i) for rank in job.trained_ids() for i in rank)
    duplicated = [i for i, c in trained.items() if c > 1]
    unknown = set(trained) - dispatched
    in_flight = records[-1].rollout.carried_out * N
    print(f"\n{len(dispatched)} samples dispatched, {sum(trained.values())} trained, {len(duplicated)} duplicated, "
          f"{in_flight} still in flight at the end; resumed {[r.rollout.resumed_samples for r in records]}, "
          f"staleness {[r.rollout.staleness_histogram for r in records]}")
    assert (duplicated, unknown) == ([], set())
    assert sum(trained.values()) == STEPS * PROMPTS * N, "each step trains prompts_per_step groups"
    assert len(dispatched) - len(trained) == in_flight, "0 lost: what was not trained is still carried over"
    assert all(int(lag) <= 2 for r in records for lag in r.rollout.staleness_histogram), "the bound holds"
    return trained


def _kill_once_it_resumes_a_carried_group(job: TrainingJob, killed: list) -> None:
    """Kills the worker at its first sight under a new version while it holds groups: the ones the step before
    interrupted at its close, resumed after the wake (looking after run(steps=1) returns races them finishing:
    on a fast machine they were done, and a step whose groups all finished before the close carries none)."""
    actor = next(iter(job.fleet.pool.slots.values())).actor
    version, deadline = 0, time.monotonic() + 300
    while time.monotonic() < deadline and version < STEPS - 1:
        progress = ray.get(actor.progress.remote())
        if progress["policy_version"] > version:
            version = progress["policy_version"]
            if progress["held"]:
                ray.kill(actor, no_restart=True)
                killed.append(version)
                return
        time.sleep(0.005)


def test_carried_groups_resume_under_the_new_policy_and_a_worker_killed_holding_one_loses_nothing(
        ray_cluster, tiny_qwen3, tmp_path):
    # Colocated: the engine sleeps while the trainer updates, so groups still generating when a step closes are
    # interrupted there, every step (disaggregated, they go on generating during the update and may finish first).
    # 192 tokens a sample: the groups a step does not train are still generating when it closes.
    config = _config(tmp_path, tiny_qwen3, "partial", workers=1,
                     settings={"run.placement": "colocated", "rollout.sampling.max_tokens": 192})
    run_dir = RunDir.create(config.run.out_dir, "partial")
    with TrainingJob(config, run_dir, progress=False) as job:
        killed: list[int] = []
        killer = threading.Thread(target=_kill_once_it_resumes_a_carried_group, args=(job, killed), daemon=True)
        killer.start()
        job.run()
        killer.join()
        assert killed, "a step closed with carried groups, resumed by the worker once it woke under the next version"
        records = [StepRecord.from_dict(r) for r in RunDir.read_jsonl(run_dir.metrics_file)]
        _check(job, records)
    lost = [e for r in records for e in r.faults if e.kind == "rollout_worker_lost"]
    assert len(lost) == 1 and sum(r.rollout.requeued for r in records) >= 1, "the carried group was generated again, whole"
    assert all(r.rollout.carried_out >= EXTRA for r in records), [r.rollout.carried_out for r in records]
    assert sum(r.rollout.resumed_samples for r in records) > 0, "some samples span two policy versions"
    for r in records:
        stale = sum(n for lag, n in r.rollout.staleness_histogram.items() if int(lag) > 0)
        assert (r.rollout.stale_tokens > 0) == (stale > 0) and r.rollout.stale_tokens <= r.rollout.tokens, r.rollout
    assert any(r.rollout.staleness_histogram.get("1") for r in records[1:]), "carried samples lag one version"


def test_carry_finish_trains_carried_groups_whole_under_the_policy_that_started_them(ray_cluster, tiny_qwen3,
                                                                                      tmp_path):
    config = _config(tmp_path, tiny_qwen3, "partial-finish", workers=1,
                     settings={"run.partial_rollout": {"enabled": True, "extra_groups": EXTRA, "max_staleness": 2,
                                                       "carry": "finish"}})
    run_dir = RunDir.create(config.run.out_dir, "partial-finish")
    with TrainingJob(config, run_dir, progress=False) as job:
        job.run()
        records = [StepRecord.from_dict(r) for r in RunDir.read_jsonl(run_dir.metrics_file)]
        _check(job, records)
    assert sum(r.rollout.resumed_samples for r in records) == 0, "never interrupted: one version per sample"
    assert sum(r.rollout.carried_out for r in records) >= EXTRA * STEPS


def test_async_mode_carries_groups_into_steps_already_queued(ray_cluster, tiny_qwen3, tmp_path):
    config = _config(tmp_path, tiny_qwen3, "partial-async", workers=1,
                     settings={"run.mode": "async", "run.max_staleness": 1,
                               "run.partial_rollout": {"enabled": True, "extra_groups": EXTRA, "max_staleness": 2}})
    run_dir = RunDir.create(config.run.out_dir, "partial-async")
    with TrainingJob(config, run_dir, progress=False) as job:
        job.run()
        records = [StepRecord.from_dict(r) for r in RunDir.read_jsonl(run_dir.metrics_file)]
        _check(job, records)
    assert sum(r.rollout.carried_out for r in records) >= EXTRA * STEPS


def test_async_without_spares_interrupts_the_groups_generating_at_each_version_and_resumes_them(ray_cluster, tiny_qwen3,
                                                                                               tmp_path):
    """extra_groups 0: nothing carries over, but async queues the next step ahead and a new version interrupts its
    groups generating and resumes them under it, instead of waiting for them (the worker's barrier)."""
    config = _config(tmp_path, tiny_qwen3, "interrupt-async", workers=1,
                     settings={"run.mode": "async", "run.max_staleness": 1, "rollout.sampling.max_tokens": 192,
                               "run.partial_rollout": {"enabled": True, "extra_groups": 0, "max_staleness": 2}})
    run_dir = RunDir.create(config.run.out_dir, "interrupt-async")
    with TrainingJob(config, run_dir, progress=False) as job:
        job.run()
        records = [StepRecord.from_dict(r) for r in RunDir.read_jsonl(run_dir.metrics_file)]
        _check(job, records, extra=0)
    assert all(r.rollout.carried_out == 0 for r in records), "no spares: every step trains its own groups"
    assert sum(r.rollout.resumed_samples for r in records) > 0, "samples interrupted at a version and resumed"


def test_a_time_budget_closes_steps_with_the_groups_done_and_carries_the_rest_losing_nothing(ray_cluster, tiny_qwen3,
                                                                                            tmp_path):
    """close_after_s with no spares, colocated: a step closes once its budget is spent with whatever groups are done
    (fewer than prompts_per_step), the rest carry over and resume; carried groups never pass prompts_per_step, no
    sample is trained twice, and every dispatched one is trained or still carried at the end."""
    config = _config(tmp_path, tiny_qwen3, "budget", workers=1,
                     settings={"run.placement": "colocated", "rollout.sampling.max_tokens": 192,
                               "run.partial_rollout": {"enabled": True, "extra_groups": 0, "max_staleness": 2,
                                                       "close_after_s": 0.05}})
    run_dir = RunDir.create(config.run.out_dir, "budget")
    with TrainingJob(config, run_dir, progress=False) as job:
        job.run()
        records = [StepRecord.from_dict(r) for r in RunDir.read_jsonl(run_dir.metrics_file)]
        dispatched = {f"{r.prompt_id}#{j}" for k in range(STEPS) for r in job.data.batch(k, PROMPTS) for j in range(N)}
        trained = Counter(_logical(i) for rank in job.trained_ids() for i in rank)
    per_step = [sum(r.rollout.groups.values()) for r in records]
    print(f"\ngroups trained per step {per_step}, carried {[r.rollout.carried_out for r in records]}, "
          f"closed by budget {[r.rollout.closed_by_budget for r in records]}")
    assert [i for i, c in trained.items() if c > 1] == [] and set(trained) <= dispatched
    assert len(dispatched) - len(trained) == records[-1].rollout.carried_out * N, "0 lost"
    assert any(r.rollout.closed_by_budget for r in records) and min(per_step) >= 1
    assert all(n < PROMPTS for n, r in zip(per_step, records) if r.rollout.closed_by_budget)
    assert max(r.rollout.carried_out for r in records) <= PROMPTS, "at most one step's prompts behind"
    assert all(int(lag) <= 2 for r in records for lag in r.rollout.staleness_histogram)
