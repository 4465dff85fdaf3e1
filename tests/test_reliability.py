"""Fault injection on a simulated multi-node Ray cluster (`ray.cluster_utils.Cluster`) with the tiny model
through real Ray, gRPC and DeepSpeed: rollout workers killed mid-generation, a replacement whose start-up
hangs, a rollout node removed,
a trainer rank killed mid-step, the rollout pool resized while it runs, a slow worker. Every job
completes its steps and the trainer ledger holds every (step, prompt, sample) exactly once — 0 lost,
0 duplicated — counting retried attempts (`s3-p1.r1#2`) as the sample they replace.
"""

import contextlib
import os
import re
import signal
import sys
import threading
import time
from collections import Counter

import pytest
from jobs import tiny_job

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402

from sparrow.coordinator.config import load_config  # noqa: E402
from sparrow.coordinator.driver import TrainingJob  # noqa: E402
from sparrow.coordinator.run_dir import RunDir  # noqa: E402
from sparrow.coordinator.step_record import StepRecord  # noqa: E402
from sparrow.tables import format_table  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    """A head node for the trainer pool and three nodes for rollout workers."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"trainer_node": 1},
                                                      "include_dashboard": False})
    nodes = [c.add_node(num_cpus=1, resources={"rollout_node": 1}) for _ in range(3)]
    ray.init(address=c.address, log_to_driver=False)
    c.wait_for_nodes()
    yield c, nodes
    ray.shutdown()
    c.shutdown()


def _job(tmp_path, model, name, workers=2, ranks=1, steps=3, prompts=4, mode="sync", max_tokens=16, settings=None):
    """Pools on the cluster fixture's labelled nodes, a checkpoint every step, leases that expire fast."""
    path = tiny_job(tmp_path / f"{name}.yaml", model, tmp_path / "runs", {
        "rollout.pool": {"size": workers, "cpus": 0.5, "node_label": "rollout_node"},
        "rollout.native": {"max_num_seqs": 8, "max_model_len": 256, "num_kv_blocks": 256},
        "rollout.sampling.max_tokens": max_tokens,
        "trainer.pool": {"size": ranks, "cpus": 0.5, "node_label": "trainer_node"},
        "run.steps": steps, "run.prompts_per_step": prompts, "run.mode": mode, "run.checkpoint_every": 1,
        "run.recovery": {"lease_timeout_s": 8, "hung_worker_timeout_s": 5},
    } | (settings or {}))
    config = load_config(path, [f"run.name={name}"])
    return config, RunDir.create(config.run.out_dir, name)


def _logical(sample_id: str) -> str:
    return re.sub(r"\.r\d+(?=#)", "", sample_id)


def _assert_exactly_once(job: TrainingJob, steps: int) -> None:
    n, p = job.config.rollout.sampling.n, job.config.run.prompts_per_step
    expected = sorted(f"s{k}-p{i}#{j}" for k in range(steps) for i in range(p) for j in range(n))
    trained = [_logical(i) for rank in job.trained_ids() for i in rank]
    counts = Counter(trained)
    lost = [i for i in expected if i not in counts]
    duplicated = [i for i, c in counts.items() if c > 1]
    print(f"\n{job.run_dir.path.name}: {len(expected)} samples dispatched, {len(trained)} trained, "
          f"{len(lost)} lost, {len(duplicated)} duplicated")
    assert (lost, duplicated) == ([], []), f"{len(lost)} lost, {len(duplicated)} duplicated"
    assert sorted(trained) == expected
    ledger = RunDir.read_jsonl(job.run_dir.ledger_file)  # what an operator checks after the fact
    assert [line["step"] for line in ledger] == list(range(steps)), "a redone step's line replaces the old one"
    on_disk = [i for line in ledger for rank in line["trained_ids"] for i in rank]
    assert sorted(on_disk) == sorted(i for rank in job.trained_ids() for i in rank)


def _print_figures(run_dir: RunDir) -> None:
    """What docs/reliability.md quotes: per step the groups per worker, retried groups, dropped samples and
    seconds; every recovery with its time (`pytest tests/test_reliability.py -s`)."""
    rows = [[r.step + 1, " ".join(f"{w}:{n}" for w, n in sorted(r.rollout.groups.items())), r.rollout.requeued,
             r.rollout.speculated, r.rollout.dropped, f"{r.timing.rollout_wait:.1f}", f"{r.timing.step:.1f}"]
            for r in _records(run_dir)]
    print(format_table(["step", "groups per worker", "retried", "backed up", "dropped", "rollout wait s", "step s"], rows))
    events = [[r.step + 1, e.kind, e.subject, "-" if e.recovery_seconds is None else f"{e.recovery_seconds:.1f}", e.detail[:70]]
              for r in _records(run_dir) for e in r.faults]
    print(format_table(["step", "event", "who", "recovery s", "detail"], events) if events else "no faults")


def _log(message: str) -> None:
    """The job's own log lines (losses, replacements, placement waits): shown with a failing test's output."""
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr)


def _when(predicate, timeout_s: float = 120.0, state=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not reached in {timeout_s:g} s. {state()}")
        time.sleep(0.05)


def _holding(job: TrainingJob, slot_index: int):
    def check():
        slot = job.fleet.pool.slots.get(slot_index)
        return slot is not None and slot.actor is not None and ray.get(slot.actor.progress.remote())["held"] > 0
    return check


def _recovered(job: TrainingJob, kinds: set[str]) -> None:
    """Between steps: supervise the fleet (as the driver does while it waits) until a recovery of one of `kinds`
    has completed, so the next step's record lists it. Ray may take seconds to declare a removed node's actors
    dead, and a vLLM replacement takes a minute to load on a busy CPU: a fixed number of steps can end first."""
    def check():
        job.fleet.check()
        return any(e.kind in kinds for e in job.fleet.resolved)

    def state() -> str:
        slots = [f"{s.worker_id}: actor {'none' if s.actor is None else 'up'}, serving call "
                 f"{'none' if s.serving is None else 'open'}, restarts {s.restarts}" for s in job.fleet.pool.slots.values()]
        return f"Fleet {job.fleet.status()}; slots: {'; '.join(slots)}; resolved: {[e.kind for e in job.fleet.resolved]}"
    _when(check, timeout_s=420, state=state)


def _records(run_dir: RunDir) -> list[StepRecord]:
    return [StepRecord.from_dict(r) for r in RunDir.read_jsonl(run_dir.metrics_file)]


def _settle(job: TrainingJob, serving: int) -> None:
    """Between steps: supervise the fleet until `serving` workers serve (the driver does this while it waits)."""
    def check():
        job.fleet.check()
        return job.fleet.status().serving == serving and len(job.fleet.pool.slots) == serving
    _when(check)


def test_killed_rollout_workers_are_replaced_and_the_pool_resizes_under_load(cluster, tiny_qwen3, tmp_path):
    config, run_dir = _job(tmp_path, tiny_qwen3, "worker-kill", steps=5, prompts=6, max_tokens=24)
    with TrainingJob(config, run_dir, progress=False, log=_log) as job:
        def fault():
            _when(_holding(job, 0))
            ray.kill(job.fleet.pool.slots[0].actor, no_restart=True)  # an actor crash mid-generation

        killer = threading.Thread(target=fault, daemon=True)
        killer.start()
        job.run(steps=1)
        killer.join()
        job.fleet.resize(3)
        _settle(job, 3)
        job.run(steps=2)
        job.fleet.resize(1)
        _settle(job, 1)
        job.run(steps=2)
        _assert_exactly_once(job, 5)
    _print_figures(run_dir)
    records = _records(run_dir)
    lost = [e for r in records for e in r.faults if e.kind == "rollout_worker_lost"]
    assert len(lost) == 1 and lost[0].subject == "rollout-0" and lost[0].recovery_seconds > 0
    assert records[0].rollout.requeued >= 1, "the killed worker's groups were generated again"
    # A step is queued when the one before it ends: step 2 was queued once the pool had grown to 3 (so all
    # three share it), step 4 once it had shrunk to 1.
    assert len(records[2].rollout.groups) == 3 and list(records[4].rollout.groups) == ["rollout-0"], \
        [r.rollout.groups for r in records]
    assert all(0 < u <= 1 for u in records[2].rollout.utilisation.values()), records[2].rollout.utilisation
    resized = [e for r in records for e in r.faults if e.kind == "pool_resized"]
    assert len(resized) == 3, "one worker added, two retired"


def test_losing_the_only_rollout_worker_keeps_a_collective_weight_channel_job_going(cluster, tiny_qwen3, tmp_path):
    """One worker, weights broadcast over a collective group (gloo here, NCCL on GPUs). When it is lost after a
    step's rollouts and before that step's publication (a replacement is starting, none serves), the publication
    goes through Ray's object store to the joining replacement; it used to form a group of the trainer alone
    and stop the job (`world_size=1`). The group forms again at the next publication."""
    config, run_dir = _job(tmp_path, tiny_qwen3, "only-worker", workers=1, steps=3, prompts=6, max_tokens=24,
                           settings={"run.weights_channel": "collective"})
    with TrainingJob(config, run_dir, progress=False, log=_log) as job:
        job.run(steps=1)
        ray.kill(job.fleet.pool.slots[0].actor, no_restart=True)

        def lost_and_joining():
            job.fleet.check()
            return job.fleet.status().serving == 0 and len(job.fleet.joining) == 1
        _when(lost_and_joining)
        stats = job.publication.publish(job.version, wait=True)  # the publication the step in flight makes at this point
        assert stats.channel == "object_store" and stats.version == job.version
        _recovered(job, {"rollout_worker_lost"})
        job.run(steps=2)
        _assert_exactly_once(job, 3)
    _print_figures(run_dir)
    records = _records(run_dir)
    assert [r.publish.channel for r in records] == ["collective"] * 3, "the group formed again with the replacement"


def test_a_job_survives_a_rollout_node_removal_and_a_trainer_rank_kill(cluster, tiny_qwen3, tmp_path):
    c, nodes = cluster
    config, run_dir = _job(tmp_path, tiny_qwen3, "node-and-trainer", ranks=2, steps=4, mode="async")
    with TrainingJob(config, run_dir, progress=False, log=_log) as job:
        job.run(steps=1)
        worker_node = ray.get(job.fleet.pool.slots[1].actor.info.remote())["node_id"]
        node = next(n for n in nodes if n.node_id == worker_node)

        def remove_node():
            _when(_holding(job, 1))
            c.remove_node(node)

        remover = threading.Thread(target=remove_node, daemon=True)
        remover.start()
        job.run(steps=1)
        remover.join()
        _recovered(job, {"rollout_worker_lost", "rollout_lease_expired"})

        # Rank 1 dies between steps 2 and 3 (a timed kill inside step 3 can come after a 0.2 s step has ended):
        # step 3's rollouts run, its training finds the rank gone, the trainer pool is rebuilt from the checkpoint.
        pid = ray.get(job.trainers.actors[1].node.remote())["pid"]
        os.kill(pid, signal.SIGKILL)
        job.run(steps=2)
        _assert_exactly_once(job, 4)
    _print_figures(run_dir)
    kinds = Counter(e.kind for r in _records(run_dir) for e in r.faults)
    assert kinds["rollout_worker_lost"] + kinds["rollout_lease_expired"] >= 1 and kinds["trainer_lost"] == 1, kinds
    assert [r.step for r in _records(run_dir)] == [0, 1, 2, 3]


@pytest.mark.parametrize("prompts,speculate_after_s,max_tokens", [(16, None, 32), (8, 1.0, 128)],
                         ids=["pending-groups", "speculation"])
def test_a_slow_worker_gives_its_share_to_the_others(cluster, tiny_qwen3, tmp_path, prompts, speculate_after_s,
                                                     max_tokens):
    """4 groups a worker at a time (8 sequences, n = 2). With 16 groups a step each worker leases 4 at once, and the
    fast one comes back for the 8 still pending while the slow one works through its first 4. With 8, both workers'
    first leases take everything: only speculation (the fast worker, idle, backs up groups held 1 s) moves them.
    The slow node runs at full speed while it holds no lease, so it asks for its share of every step (stopped
    between steps, it would lose that race to the fast worker and there would be nothing to back up). Speculation
    needs groups the slow worker holds for seconds: at 32 tokens it could finish them in one of its 0.1 s running
    slices, before or just after the backup started, and its own attempt won (seen once on a 2-core CI machine)."""
    settings = {} if speculate_after_s is None else {"run.recovery.speculate_after_s": speculate_after_s}
    config, run_dir = _job(tmp_path, tiny_qwen3, "slow", steps=2, prompts=prompts, max_tokens=max_tokens,
                           settings=settings)
    with TrainingJob(config, run_dir, progress=False, log=_log) as job:
        info = ray.get(job.fleet.pool.slots[0].actor.info.remote())
        pid, slow = info["pid"], info["worker_id"]
        stop = threading.Event()

        def throttle():  # SIGSTOP/SIGCONT while it holds leases: a tenth of its speed, never long enough to expire them
            while not stop.is_set():
                if not ray.get(job.dispatcher.holds.remote(slow)):
                    time.sleep(0.05)
                    continue
                os.kill(pid, signal.SIGSTOP)
                time.sleep(0.9)
                os.kill(pid, signal.SIGCONT)
                time.sleep(0.1)

        t = threading.Thread(target=throttle, daemon=True)
        t.start()
        try:
            records = job.run()
        finally:
            stop.set()
            t.join()
            os.kill(pid, signal.SIGCONT)
        _assert_exactly_once(job, 2)
    _print_figures(run_dir)
    groups = Counter()
    for r in records:
        groups.update(r.rollout.groups)
    assert groups["rollout-1"] > groups["rollout-0"], groups
    assert (sum(r.rollout.speculated for r in records) > 0) == (speculate_after_s is not None)


def _rollout_worker_pids() -> set[int]:
    """Processes that host a rollout worker actor (Ray titles a worker process after the actor it runs)."""
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if f.read().startswith(b"ray::RolloutWorker"):
                    pids.add(int(entry))
        except (OSError, ValueError):
            continue
    return pids


def test_a_replacement_that_hangs_at_start_is_replaced_in_turn(cluster, tiny_qwen3, tmp_path):
    """A replacement whose start-up hangs (its process stopped with SIGSTOP as soon as Ray gives it the actor)
    never serves; after `run.recovery.join_timeout_s` the fleet kills it and starts another, which serves."""
    join_timeout_s = 20.0
    config, run_dir = _job(tmp_path, tiny_qwen3, "hung-start", steps=2, prompts=4,
                           settings={"run.recovery.join_timeout_s": join_timeout_s})
    lines: list[str] = []

    def log(message: str) -> None:
        lines.append(message)
        _log(message)

    with TrainingJob(config, run_dir, progress=False, log=log) as job:
        job.run(steps=1)
        known = _rollout_worker_pids()
        stopped: list[int] = []

        def stop_the_replacement():
            def started():
                stopped.extend(_rollout_worker_pids() - known)
                return bool(stopped)
            _when(started, timeout_s=60)
            os.kill(stopped[0], signal.SIGSTOP)

        stopper = threading.Thread(target=stop_the_replacement, daemon=True)
        ray.kill(job.fleet.pool.slots[1].actor, no_restart=True)
        stopper.start()
        try:
            _recovered(job, {"rollout_worker_lost"})
        finally:
            stopper.join()
            for pid in stopped:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
        job.run(steps=1)
        _assert_exactly_once(job, 2)
        assert job.fleet.pool.slots[1].restarts == 2
    _print_figures(run_dir)
    hung = [line for line in lines if "not serving (run.recovery.join_timeout_s=20)" in line]
    assert len(hung) == 1 and "rollout-1 lost (started" in hung[0] and "restart 2 of 3" in hung[0], lines
    lost = [e for r in _records(run_dir) for e in r.faults if e.kind == "rollout_worker_lost"]
    assert len(lost) == 1 and lost[0].subject == "rollout-1" and lost[0].recovery_seconds > join_timeout_s, lost


@pytest.mark.vllm
def test_a_killed_vllm_worker_is_replaced(cluster, tiny_qwen3, tmp_path, monkeypatch):
    """The only rollout worker, a vLLM engine, is killed holding a lease: its samples wait for the replacement engine
    and are trained exactly once. One worker, not two, spares the suite a vLLM load (2-core CPU: 202 s -> 133-152 s);
    a pool that keeps serving while a member is replaced is the native tests' case.

    The same job is also the suite's `sparrow train` with `rollout.engine=vllm` (it was tests/test_train_vllm.py, a
    third vLLM load, 60-90 s): the first step's samples, all with the initial schedule, α measured on every trained
    token, and after each step the trainer's new weights served by the vLLM worker, the replacement included."""
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core stays in the worker's process
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config, run_dir = _job(tmp_path, tiny_qwen3, "vllm-kill", steps=2, max_tokens=16)
    config = load_config(None, [
        f"model={tiny_qwen3}", "rollout.engine=vllm", "rollout.vllm.max_model_len=512", "rollout.vllm.max_num_seqs=8",
        "rollout.vllm.kv_cache_memory_bytes=268435456", "rollout.sampling={max_tokens: 16, n: 2, temperature: 1.0}",
        "rollout.schedule={name: tiny, edges: [80], topk_blocks: [2, 3]}", "rollout.pool={size: 1, cpus: 0.5, node_label: rollout_node}",
        "trainer.pool={size: 1, cpus: 0.5, node_label: trainer_node}", "trainer.micro_batch_tokens=512",
        "trainer.recompute_topk=8", "controller.ladder=[1, 2, 3, 4, 6]", "controller.min_samples=20",
        "metrics.port=0", "run.steps=2", "run.prompts_per_step=4", "run.mode=sync",
        "run.recovery={lease_timeout_s: 8, hung_worker_timeout_s: 5}", f"run.out_dir={run_dir.path.parent}",
    ])
    with TrainingJob(config, run_dir, progress=False, log=_log) as job:
        assert job.fleet.workers[0]["engine"] == "VllmEngine"

        def fault():
            _when(_holding(job, 0))
            ray.kill(job.fleet.pool.slots[0].actor, no_restart=True)

        killer = threading.Thread(target=fault, daemon=True)
        killer.start()
        job.run(steps=1)
        killer.join()
        assert ray.get(job.fleet.pool.slots[0].actor.policy_version.remote()) == 1, "weights reached the replacement"
        _recovered(job, {"rollout_worker_lost"})
        job.run(steps=1)
        assert ray.get(job.fleet.pool.slots[0].actor.policy_version.remote()) == 2, "weights reached the vLLM worker"
        _assert_exactly_once(job, 2)
    _print_figures(run_dir)
    records = _records(run_dir)
    lost = [e for r in records for e in r.faults if e.kind == "rollout_worker_lost"]
    assert len(lost) == 1 and lost[0].subject == "rollout-0"
    assert records[0].rollout.schedule_versions == [0]
    for r in records:
        assert r.rollout.samples == 8 and r.rollout.failed == 0, r.rollout
        assert sum(r.alpha.tokens) == r.train["train/loss_tokens"] > 0
