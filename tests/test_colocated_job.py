"""`sparrow train` with `run.placement: colocated` through real Ray, gRPC and DeepSpeed on the CPU.

Rollout worker i and trainer rank i share bundle i; each step the engines give their KV pools back before the
update and take them again after the new version is handed over in place (shared memory on the CPU, CUDA IPC
on a GPU). Every sample is trained on exactly once, the workers serve exactly the trainer's weights, and a
worker killed while a step trains (its hand-off interrupted) is replaced and gets the current version.
"""

import re
import threading
import time

import pytest
import torch
from jobs import expected_ids, tiny_job

ray = pytest.importorskip("ray")

from sparrow.coordinator.config import load_config  # noqa: E402
from sparrow.coordinator.driver import TrainingJob  # noqa: E402
from sparrow.coordinator.run_dir import RunDir  # noqa: E402
from sparrow.weight_sync import HandleSource, receive_state_dict  # noqa: E402

pytestmark = pytest.mark.slow


def _job(tmp_path, model, steps: int, gpus: int = 2, settings: dict | None = None):
    path = tiny_job(tmp_path / "job.yaml", model, tmp_path / "runs", {
        "rollout.pool.size": gpus, "trainer.pool.size": gpus, "run.steps": steps, "run.placement": "colocated",
        "run.recovery": {"join_timeout_s": 120},
    } | (settings or {}))
    return load_config(path)


def _served_equals_trained(job: TrainingJob) -> None:
    report = job.trainers.call_all("publish_weights", job.version, "object_store")[0]
    trainer_state, _ = receive_state_dict(HandleSource(report.handle))
    for actor in job.fleet.actors:
        assert ray.get(actor.policy_version.remote()) == job.version
        served = ray.get(actor.parameters.remote(list(trainer_state)))
        for name, tensor in trainer_state.items():
            assert torch.equal(served[name], tensor), name


def test_a_colocated_job_takes_turns_and_hands_weights_over_in_place(ray_cluster, tiny_qwen3, tmp_path):
    config = _job(tmp_path, tiny_qwen3, steps=2)
    assert config.run.staleness == 0
    with TrainingJob(config, RunDir.create(config.run.out_dir, "colocated"), progress=False, log=lambda *_: None) as job:
        assert job.channel == "shared"
        records = job.run()
        trained = sum(job.trained_ids(), [])
        assert len(trained) == len(set(trained)) and sorted(trained) == sorted(expected_ids(job, range(2)))
        assert all(job.trained_ids()), "both ranks trained on a shard"
        _served_equals_trained(job)
    for r in records:
        assert r.publish.channel == "shared" and r.publish.waited and r.publish.bytes > 0
        t = r.timing
        assert t.to_train > 0 and t.to_rollout > 0
        assert set(t.transitions) == {"engine_sleep", "trainer_reload", "kv_gb_released", "trainer_offload", "engine_wake"}
        assert t.transitions["kv_gb_released"] > 0, "the engines' KV pools were given back during the update"
    assert not ray.util.list_named_actors() and not ray.util.placement_group_table() or all(
        g["state"] == "REMOVED" for g in ray.util.placement_group_table().values()), "the job left its bundles behind"


def test_a_worker_killed_while_its_step_trains_is_replaced_and_gets_the_version(ray_cluster, tiny_qwen3, tmp_path):
    """The kill lands after the step's rollouts, while the engines sleep and the update runs: the worker's
    hand-off of that version fails; its replacement takes the version through the object store, the next one in
    place, and no sample is lost or trained twice."""
    config = _job(tmp_path, tiny_qwen3, steps=3)
    with TrainingJob(config, RunDir.create(config.run.out_dir, "kill"), progress=False, log=lambda *_: None) as job:
        job.run(steps=1)
        victim = job.fleet.pool.slots[1].actor

        def rolled_out() -> bool:
            try:
                return ray.get(job.dispatcher.progress.remote(1))[2]
            except ray.exceptions.RayTaskError:  # the driver took the step already: its rollouts are in
                return True

        def kill_once_step_two_is_rolled_out():
            while not rolled_out():
                time.sleep(0.05)
            ray.kill(victim, no_restart=True)

        killer = threading.Thread(target=kill_once_step_two_is_rolled_out, daemon=True)
        killer.start()
        records = job.run()
        killer.join(timeout=60)
        trained = sum(job.trained_ids(), [])
        assert len(trained) == len(set(trained)), "a sample was trained on twice"
        assert sorted(trained) == sorted(expected_ids(job, range(3))), "a sample was lost"
        faults = [f for r in records for f in r.faults]
        assert [f.subject for f in faults] == ["rollout-1"] and faults[0].recovery_seconds is not None
        assert len(job.fleet.live) == 2
        _served_equals_trained(job)


def _within(seconds: float, work) -> None:
    """Run `work` on a thread and fail, instead of hanging the suite, if it has not returned in time."""
    runner = threading.Thread(target=work, daemon=True)
    runner.start()
    runner.join(timeout=seconds)
    assert not runner.is_alive(), f"{work} did not return within {seconds:g} s"


def test_a_replacement_joins_only_once_it_holds_the_jobs_version(ray_cluster, tiny_qwen3, tmp_path):
    """The only worker is lost after a publication, and its replacement starts serving before the driver next
    waits on the rollout side (here: supervised between steps, as the driver's ticks during the trainer's offload
    do). Serving alone is not joined: the shared channel gave it no weights, and at version 0 it can lease neither
    the evaluation of version 1 nor anything of the next step (staleness 0). It stays a joiner until the driver,
    waiting for either, hands it the job's version; both then complete (it used to count as joined at version 0,
    never got the version, and the step waited forever)."""
    config = _job(tmp_path, tiny_qwen3, steps=2, gpus=1,
                  settings={"data.eval": {"every": 1, "prompts": 2, "samples": 1}})
    with TrainingJob(config, RunDir.create(config.run.out_dir, "join"), progress=False, log=lambda *_: None) as job:
        job.run(steps=1)
        victim = job.fleet.pool.slots[0].actor
        ray.kill(victim, no_restart=True)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            job.fleet.check()
            slot = job.fleet.pool.slots[0]
            if slot.actor not in (None, victim) and ray.get(slot.actor.progress.remote())["serving"]:
                break
            time.sleep(0.05)
        assert ray.get(slot.actor.policy_version.remote()) == 0 and job.version == 1
        job.fleet.check()
        assert job.fleet.joining == [slot] and job.fleet.live == [], "serving at version 0 is not joined"
        _within(120, job.steps.evaluate)
        assert job.steps.evaluations[-1].policy_version == 1
        _within(180, job.run)
        assert job.step == 2 and [s.worker_id for s in job.fleet.live] == ["rollout-0"]
        trained = [re.sub(r"\.r\d+#", "#", i) for i in sum(job.trained_ids(), [])]  # retried groups: new attempts
        assert len(trained) == len(set(trained)) and sorted(trained) == sorted(expected_ids(job, range(2)))
        _served_equals_trained(job)
