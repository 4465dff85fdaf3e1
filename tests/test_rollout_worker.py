"""A real `RolloutWorker` (native engine, tiny model) against a real trajectory server and a plain `Dispatcher`,
without Ray: exclusive work (the speedup probe) granted while the worker still generates groups waits for them.

The queue grants a probe to a worker it sees idle, and it can see a busy worker idle: its leases expired on a slow
engine, or the fleet released it. The worker's open engine stream holds the engine, so a probe run at once used to
wait for the worker's own lock forever (found in a fresh-clone CI run, with vLLM on a busy CPU)."""

import threading
import time

import pytest
import torch

from sparrow.coordinator.config import load_config
from sparrow.coordinator.data import PromptSource


def test_a_probe_granted_while_groups_generate_runs_after_them(tiny_qwen3):
    from sparrow.coordinator.dispatcher import Dispatcher
    from sparrow.coordinator.fleet import WorkerSetup
    from sparrow.coordinator.rollout_worker import RolloutWorker
    from sparrow.coordinator.transport import JobCredentials, TrajectoryServer

    config = load_config(overrides=[
        f"model={tiny_qwen3}", "metrics.enabled=false", "rollout.speedup_probe_every=0",
        "rollout.native={max_num_seqs: 8, max_model_len: 512, num_kv_blocks: 128}",
        "rollout.sampling={max_tokens: 200, n: 2, temperature: 1.0}",
    ])
    records = PromptSource(config.data, seed=0).batch(0, 2)
    credentials = JobCredentials.create(config.transport)
    worker = RolloutWorker(config.worker_payload(), str(tiny_qwen3), 0, torch.get_num_threads(), credentials)
    dispatcher = Dispatcher(max_staleness=1, lease_timeout_s=60)
    dispatcher.add_step(0, records, [])  # an idle worker's first lease would be a probe: step 0 has none
    try:
        with TrajectoryServer(config.transport, credentials) as server:
            serving = threading.Thread(target=worker.serve, daemon=True,
                                       args=(dispatcher, WorkerSetup(server.address, config.schedule_template(), None)))
            serving.start()
            deadline = time.monotonic() + 60
            while not worker._held and time.monotonic() < deadline:
                time.sleep(0.01)
            assert worker._held, "the worker generates step 0's groups"
            dispatcher.add_step(1, records, records[:1])
            dispatcher.release(worker.worker_id)  # the queue now sees it idle: its next lease is step 1's probe
            deadline = time.monotonic() + 120
            while not (dispatcher.progress(0)[2] and dispatcher.progress(1)[2]) and time.monotonic() < deadline:
                time.sleep(0.05)
            done = [dispatcher.progress(step) for step in (0, 1)]
            worker.stop()
            serving.join(timeout=60)
    finally:
        worker.shutdown()
    assert all(d[2] for d in done) and not serving.is_alive(), f"(groups done, total, complete) per step: {done}"
    first, second = dispatcher.take_step(0), dispatcher.take_step(1)
    assert second.probe_result is not None and second.probe_result.speedup > 0
    assert len(first.done) == len(second.done) == 2 and first.requeued >= 1, "released groups were generated again"


def test_a_probe_longer_than_a_lease_is_renewed_while_it_runs_and_completes_once(tiny_qwen3):
    """A speedup probe decodes a step's prompts four times (warm-up and timed, sparse and dense): over long
    generations that outlasts a lease. Its lease used to be left unrenewed, so it expired, the finished probe was
    refused and granted again, forever: a CPU job at 384 tokens never finished its first probed step."""
    from sparrow.coordinator.dispatcher import Dispatcher
    from sparrow.coordinator.fleet import WorkerSetup
    from sparrow.coordinator.rollout_worker import RolloutWorker
    from sparrow.coordinator.transport import JobCredentials, TrajectoryServer

    lease_s = 0.6
    config = load_config(overrides=[
        f"model={tiny_qwen3}", "metrics.enabled=false", "rollout.speedup_probe_every=0",
        "rollout.native={max_num_seqs: 8, max_model_len: 1024, num_kv_blocks: 256}",
        "rollout.sampling={max_tokens: 300, n: 4, temperature: 1.0, ignore_eos: true}",
        f"run.recovery.lease_timeout_s={lease_s}",  # the worker renews every quarter of it
    ])
    records = PromptSource(config.data, seed=0).batch(0, 2)
    credentials = JobCredentials.create(config.transport)
    worker = RolloutWorker(config.worker_payload(), str(tiny_qwen3), 0, torch.get_num_threads(), credentials)
    dispatcher = Dispatcher(max_staleness=1, lease_timeout_s=lease_s)
    dispatcher.add_step(0, records[:1], records)  # the idle worker's first lease is the probe, then the group
    expired = []
    try:
        with TrajectoryServer(config.transport, credentials) as server:
            serving = threading.Thread(target=worker.serve, daemon=True,
                                       args=(dispatcher, WorkerSetup(server.address, config.schedule_template(), None)))
            start = time.monotonic()
            serving.start()
            while not dispatcher.progress(0)[2] and time.monotonic() < start + 120:
                expired += dispatcher.take_expired()  # what the fleet does each turn
                time.sleep(0.05)
            took = time.monotonic() - start
            done = dispatcher.progress(0)
            worker.stop()
            serving.join(timeout=60)
    finally:
        worker.shutdown()
    assert done[2], f"the probed step never completed in {took:.0f} s; leases expired: {len(expired)}"
    assert took > 4 * lease_s, f"the probe ran {took:.1f} s: too short to outlast a {lease_s} s lease"
    assert expired == [], "the running probe's lease expired"
    probe = dispatcher.take_step(0).probe_result
    assert probe is not None and probe.speedup > 0


def test_the_engine_starts_with_the_schedule_the_job_hands_its_worker(tiny_qwen3):
    """A worker's engine starts under the job's schedule in force (the fleet passes it, inline), before `serve`: an
    engine that fixes its kernels when it starts (vLLM's full decode graphs) must start sparse to run sparse."""
    from sparrow.coordinator.rollout_worker import RolloutWorker
    from sparrow.coordinator.transport import JobCredentials

    config = load_config(overrides=[
        f"model={tiny_qwen3}", "metrics.enabled=false",
        "rollout.schedule={name: small, topk_blocks: [2, 4], edges: [160]}",
        "rollout.native={max_num_seqs: 8, max_model_len: 512, num_kv_blocks: 64}",
    ])
    in_force = config.initial_schedule().with_topk([3, 5], version=4)  # as the controller left it
    credentials = JobCredentials.create(config.transport)
    started = RolloutWorker(config.worker_payload(), str(tiny_qwen3), 0, 1, credentials, in_force.to_dict())
    dense = RolloutWorker(config.worker_payload(), str(tiny_qwen3), 1, 1, credentials)
    try:
        assert started.engine.schedule == in_force and started.engine.schedule_version == 4
        assert dense.engine.schedule is None and dense.engine.schedule_version == -1
    finally:
        started.shutdown()
        dense.shutdown()
