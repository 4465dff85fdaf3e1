"""`RolloutWorker`: one rollout engine as a Ray actor that pulls GRPO groups from the job's `Dispatcher`.

`serve(dispatcher)` is the worker's life: while the engine has room it leases groups (as many as fit,
at most its fair share), feeds their requests into one open engine stream, and as each group's n
samples finish it scores them and sends them to the trainer pool's TrajectoryServer over gRPC, then
completes the lease. A heartbeat thread renews the leases while the engine makes progress (a hung
engine stops renewing, and its groups go back to the queue); a lease the dispatcher no longer
honours is aborted in the engine and its samples are dropped.

Weights and schedules are control calls over Ray (`load_weights`, `receive_weights`,
`set_schedule`). Each is applied at a barrier: the worker stops leasing, lets its groups finish,
closes the stream, applies, and resumes, so every sample has exactly one policy version and one
schedule version. A plain class: `pools.py` wraps it with `ray.remote`; tests may use it directly.
"""

import asyncio
import logging
import os
import queue
import statistics
import threading
import time
from dataclasses import dataclass, field, replace

import ray
import torch

from sparrow.coordinator.metrics import BatchOccupancy, BusyRate, EngineTime, SparrowMetrics, start_metrics_server
from sparrow.coordinator.transport import JobCredentials, Trajectory, TrajectoryClient, TransportError, advertised_host
from sparrow.rollout_workers.api import INTERRUPTED, RequestFeed, RolloutRequest, RolloutSample, SamplingParams
from sparrow.rollout_workers.registry import create_engine
from sparrow.rollout_workers.resume import join, resume_request
from sparrow.schedule import SparsitySchedule
from sparrow.seeds import stable_seed
from sparrow.weight_sync import SharedMappings, current_gpu

from .config import SparrowConfig
from .dispatcher import DispatcherClient
from .data import render_prompt
from .rewards import RewardFunction, reward_metadata
from .step_record import GroupReport
from .step_record import EvalRecord, EvalResult
from .speedup_probe import measure_speedup
from .work_queue import EvalTask, GroupTask, Lease, LeaseError, ProbeTask

POLL_S = 0.05
_DONE = object()
log = logging.getLogger("sparrow.rollout")


@dataclass
class _Group:
    lease: Lease
    request: RolloutRequest
    started: float
    samples: list[RolloutSample] = field(default_factory=list)
    running: dict[str, int | None] = field(default_factory=dict)
    """Engine request ids in flight -> the sample a resumed part continues (None: the group's own request)."""
    outstanding: dict[str, int] = field(default_factory=dict)
    """Samples each running request has still to return."""
    parts: dict[int, list[RolloutSample]] = field(default_factory=dict)
    """Interrupted parts by sample index (partial rollouts), joined when the sample finishes."""
    interrupted: bool = False
    """Its running requests were asked to stop for a weight change; they resume once it is done."""

    def run(self, request: RolloutRequest, sample: int | None) -> RolloutRequest:
        self.running[request.request_id] = sample
        self.outstanding[request.request_id] = request.sampling.n
        return request

    def parked(self) -> list[int]:
        """Samples interrupted and not resumed yet (once the group's own request has returned all of its)."""
        if None in self.running.values():
            return []
        return [i for i, parts in self.parts.items() if parts[-1].finish_reason == INTERRUPTED and i not in self.running.values()]


class RolloutWorker:
    def __init__(self, config: dict, model: str, index: int, threads: int, credentials: JobCredentials,
                 schedule: dict | None = None):
        """`schedule`: the job's schedule in force (`to_dict`), which the engine starts with; None = dense until
        `serve` applies the job's."""
        torch.set_num_threads(threads)
        self.config = SparrowConfig.model_validate(config)
        self.index, self.worker_id, self.credentials = index, f"rollout-{index}", credentials
        engine_config = self.config.rollout.engine_config()
        self.model_dir = engine_config.model or model
        seed = stable_seed(self.config.run.seed, index, 2) % (2**31)
        self.engine = create_engine(self.config.rollout.engine, engine_config.model_copy(
            update={"model": self.model_dir, "seed": seed, "schedule": schedule}))
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.client: TrajectoryClient | None = None
        self.trajectory_address: str | None = None
        self.metrics = SparrowMetrics.for_rollout(self.config.metrics, index)
        self.metrics_server = start_metrics_server(self.metrics) if self.config.metrics.enabled else None
        self.reward = RewardFunction(self.config.reward, self.config.data.source, on_error=self.metrics.record_reward_error)
        self.weight_group = None
        self._engine_lock = threading.Lock()
        """Held by `serve` while an engine stream is open; control calls take it to change weights or schedule."""
        self._sync_lock = threading.Lock()
        self._sync_wanted = threading.Event()
        self._stop = threading.Event()
        self._held: dict[int, _Group] = {}
        self._alone: dict[int, bool] = {}
        """Probes and evaluations granted and not yet done, by lease id (True while the engine runs one): renewed like
        the held groups, since one over long generations (several passes of a step's prompts) outlasts a lease."""
        self._lost: set[int] = set()
        self._held_lock = threading.Lock()
        self._busy_seconds = 0.0
        self._occupancy = BatchOccupancy()
        """Busy seconds by samples in flight: the step's batch shape (busy-batch fraction, tail share)."""
        self._rate = BusyRate()
        self._tokens = self._samples = 0
        self._serving = False
        self._asleep = False
        """The engine gave its memory back (`sleep`): nothing is leased until `wake`."""
        self._shared_mappings = SharedMappings()
        """The colocated trainer rank's weight buffers, mapped once (`load_shared_weights`)."""
        self._probed_modes: set[str] = set()
        """Modes a speedup probe has run (untimed) once on this engine: its later passes are timed warm."""
        partial = self.config.run.partial_rollout
        self._interrupt_on_sync = partial.enabled and partial.carry == "resume"
        """Partial rollouts: held groups stop at a weight change (or sleep) and resume after it."""

    # ------------------------------------------------------------------ set-up and control

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            "worker_id": self.worker_id, "node_id": ctx.get_node_id(), "pid": os.getpid(),
            "metrics_url": self.metrics_server.url if self.metrics_server else None,
            "engine": type(self.engine).__name__, "host": advertised_host(self.config.transport.host),
            "gpu": current_gpu(),
        }

    def connect(self, trajectory_address: str) -> None:
        """(Re)connect to the trainer pool's TrajectoryServer (after a trainer restart it moves)."""
        if trajectory_address == self.trajectory_address:
            return
        old, self.client = self.client, TrajectoryClient(trajectory_address, self.config.transport, self.credentials,
                                                         client_id=self.worker_id)
        self.trajectory_address = trajectory_address
        if old is not None:
            old.close()

    def _exclusive(self, apply):
        """Run `apply` on an idle engine: stop leasing, let the held groups finish, apply, resume."""
        with self._sync_lock:
            self._sync_wanted.set()
            try:
                with self._engine_lock:
                    return apply()
            finally:
                self._sync_wanted.clear()

    def set_schedule(self, schedule: SparsitySchedule | None) -> int:
        self._exclusive(lambda: self._apply_schedule(schedule))
        return self.engine.schedule_version

    def _apply_schedule(self, schedule: SparsitySchedule | None) -> None:
        self.engine.set_schedule(schedule)
        if schedule is not None:
            self.metrics.set_schedule(schedule)

    def load_weights(self, handle, rollback: bool = False) -> dict:
        """A version published to Ray's object store (`WeightHandle`); `rollback`: it may be older than
        the one served (the trainer restarted from a checkpoint)."""
        from sparrow.weight_sync import HandleSource, WeightReceiver

        def load():
            if not rollback and _handle_version(handle) <= self.engine.policy_version:
                return None  # a joining worker can get a version both in its set-up and from a publication
            return WeightReceiver(self.engine).receive(HandleSource(handle), allow_older=rollback)

        report = self._exclusive(load)
        if report is None:
            return {"version": self.engine.policy_version, "bytes": 0, "seconds": 0.0}
        self.metrics.policy_version.labels(worker=self.worker_id, pool="rollout").set(report.version)
        return {"version": report.version, "bytes": report.nbytes, "seconds": report.seconds}

    def load_shared_weights(self, handles: list, rollback: bool = False) -> dict:
        """A version in the shared buffers of the trainer rank on this worker's GPU (`handles`: one per rank), read
        in place: no host round trip. On a CPU (shared memory, colocated) worker i reads rank i's. A worker whose
        GPU holds no rank (a replacement placed elsewhere) loads nothing and says so (`"version": None`)."""
        from sparrow.weight_sync import SharedSource, WeightReceiver

        gpu = current_gpu()
        if gpu is None:
            handle = handles[self.index % len(handles)]
        else:
            handle = next((h for h in handles if h.buffers and h.buffers[0].device_uuid == gpu), None)
            if handle is None:
                return {"version": None, "worker": self.index, "bytes": 0, "seconds": 0.0}
        source = SharedSource(handle, self._shared_mappings)
        report = self._exclusive(lambda: WeightReceiver(self.engine).receive(source, allow_older=rollback))
        self.metrics.policy_version.labels(worker=self.worker_id, pool="rollout").set(report.version)
        return {"version": report.version, "bytes": report.nbytes, "seconds": report.seconds}

    def sleep(self) -> dict:
        """Give the engine's KV memory back (colocated placement: the trainer rank on this GPU takes its turn).
        Leasing stops first and the groups held finish; no group is leased until `wake`."""
        def release():
            self._asleep = True
            return self.engine.sleep()

        done = self._exclusive(release)
        return {"seconds": done.seconds, "bytes": done.bytes}

    def wake(self) -> dict:
        done = self._exclusive(self.engine.wake)
        self._asleep = False
        return {"seconds": done.seconds, "bytes": done.bytes}

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        from sparrow.weight_sync import CollectiveGroup

        if self.weight_group is not None:
            self.weight_group.close()
        device = "cuda" if backend == "nccl" else "cpu"
        self.weight_group = CollectiveGroup(host, port, rank, world_size, backend=backend, device=device, timeout_s=timeout_s)

    def receive_weights(self, rollback: bool = False) -> dict:
        """The next version broadcast over the weight group (the trainer sends concurrently)."""
        from sparrow.weight_sync import CollectiveSource, WeightReceiver

        source = CollectiveSource(self.weight_group)
        report = self._exclusive(lambda: WeightReceiver(self.engine).receive(source, allow_older=rollback))
        self.metrics.policy_version.labels(worker=self.worker_id, pool="rollout").set(report.version)
        return {"version": report.version, "bytes": report.nbytes, "seconds": report.seconds}

    def progress(self) -> dict:
        return {"worker": self.worker_id, "serving": self._serving, "tokens": self._tokens, "samples": self._samples,
                "busy_seconds": self._busy_seconds, "held": len(self._held), "policy_version": self.engine.policy_version,
                "schedule_version": self.engine.schedule_version}

    def engine_stats(self) -> dict:
        """The engine's own counters and settings as it resolved them (e.g. vLLM's CUDA-graph mode), for benchmarks."""
        return self.engine.stats()

    def parameters(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Copies of the served weights by HF name (for checks and debugging)."""
        return self.engine.parameters(names)

    def policy_version(self) -> int:
        return self.engine.policy_version

    def stop(self) -> None:
        """End `serve` once the groups it holds are finished and sent."""
        self._stop.set()

    def shutdown(self) -> None:
        self._stop.set()
        if self.client is not None:
            self.client.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.engine.shutdown()

    # ------------------------------------------------------------------ the pull loop

    @ray.method(concurrency_group="loop")
    def serve(self, dispatcher, setup) -> dict:
        """Take the job's current state (`fleet.WorkerSetup`), then pull and generate until `stop()`."""
        self.connect(setup.trajectory_address)
        self._apply_schedule(setup.schedule)
        self.metrics.policy_version.labels(worker=self.worker_id, pool="rollout").set(self.engine.policy_version)
        if setup.weights is not None:
            self.load_weights(setup.weights)
        self._dispatcher = DispatcherClient(dispatcher)
        self._serving = True
        self._heartbeat_error: BaseException | None = None
        heartbeat = threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)
        heartbeat.start()
        sender = _Sender(self)
        stream: _EngineStream | None = None
        waiting: list[Lease] = []  # probes / evaluations granted while groups still generate: they run after them
        capacity = max(1, self.engine.max_concurrent_samples // self.config.rollout.sampling.n)
        last, busy, in_flight = time.perf_counter(), False, 0
        try:
            while True:
                now = time.perf_counter()
                if busy:  # the engine had groups (or a probe) since the last turn
                    self._busy_seconds += now - last
                    self._occupancy.add(in_flight, now - last)
                last = now
                in_flight = min(self.engine.counters().samples_running, self.engine.max_concurrent_samples)
                if stream is not None:
                    for sample in stream.finished():
                        self._collect(sample, sender)
                self._abandon_lost(stream)
                held = len(self._held)
                if self._stop.is_set() and not held and sender.idle:
                    break
                wants_sync = self._sync_wanted.is_set() or self._stop.is_set() or bool(waiting) or self._asleep
                if stream is not None and self._interrupt_on_sync and (self._sync_wanted.is_set() or self._asleep):
                    self._interrupt_held()
                if not wants_sync and any(g.parked() for g in self._held.values()):
                    stream = stream or _EngineStream(self)
                    self._resume_held(stream)
                leases = []
                if not wants_sync and held < capacity:
                    leases = self._lease(capacity - held)
                    with self._held_lock:
                        self._alone.update((lease.lease_id, False) for lease in leases if lease.exclusive)
                alone = waiting + [lease for lease in leases if lease.exclusive]
                groups = [lease for lease in leases if not lease.exclusive]
                if groups:
                    stream = stream or _EngineStream(self)
                    for lease in groups:
                        self._start(lease, stream)
                if stream is not None and not self._engine_busy() and (wants_sync or alone or not groups):
                    stream.close()
                    stream = None
                # The queue grants exclusive work to a worker it sees idle, which can happen while this one
                # still generates groups whose leases expired (a slow engine): the open stream holds the engine,
                # so that work waits until the groups are done and the stream is closed.
                waiting, alone = (alone, []) if stream is not None else ([], alone)
                for lease in alone:
                    self._run_alone(lease)
                sender.raise_errors()
                if self._heartbeat_error is not None:
                    raise self._heartbeat_error
                busy = bool(self._held or alone)
                self._report_throughput(idle=not busy)
                if not groups and not alone:
                    time.sleep(POLL_S)
        finally:
            if stream is not None:
                stream.close()
            sender.close()
            self._stop.set()
            self._serving = False
            heartbeat.join(timeout=5)
        return {"worker": self.worker_id, "tokens": self._tokens, "samples": self._samples}

    def _report_throughput(self, idle: bool) -> None:
        """`sparrow_rollout_tokens_per_second`: tokens per engine-busy second, each busy second or burst of work."""
        rate = self._rate.update(self.engine.counters().tokens_generated, self._busy_seconds, idle)
        if rate is not None:
            self.metrics.tokens_per_second.labels(worker=self.worker_id, pool="rollout").set(rate)

    def _lease(self, groups: int) -> list[Lease]:
        return self._dispatcher.lease(self.worker_id, self.engine.policy_version, groups, self._engine_time())

    def _engine_time(self) -> EngineTime:
        return EngineTime(self._busy_seconds, tuple(self._occupancy.seconds))

    def _requests(self, task: GroupTask) -> RolloutRequest:
        s, r = self.config.rollout.sampling, task.record
        sampling = SamplingParams(
            max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
            seed=stable_seed(self.config.run.seed, task.step, r.index, 3), n=s.n, logprobs=s.logprobs,
            ignore_eos=s.ignore_eos,
        )
        ids = render_prompt(self.tokenizer, r.messages, self.config.data.chat_template)
        meta = {"step": str(task.step), "answer": r.answer, "index": str(r.index)}
        return RolloutRequest(task.request_id, tuple(ids), sampling, metadata=meta)

    def _start(self, lease: Lease, stream: "_EngineStream") -> None:
        group = _Group(lease, self._requests(lease.task), time.perf_counter())
        with self._held_lock:
            self._held[lease.lease_id] = group
        stream.feed.put(group.run(group.request, None))

    def _engine_busy(self) -> bool:
        """Some held group has requests in the engine (parked ones wait for the next stream)."""
        return any(g.running for g in list(self._held.values()))

    def _interrupt_held(self) -> None:
        """Stop the held groups' requests, keeping their tokens, before a weight change or a sleep."""
        for g in list(self._held.values()):
            if not g.interrupted:
                g.interrupted = True
                for request_id in list(g.running):
                    self.engine.interrupt(request_id)

    def _resume_held(self, stream: "_EngineStream") -> None:
        """Each interrupted sample continues as a request of its own, under the weights in force now."""
        for g in list(self._held.values()):
            g.interrupted = False
            for i in g.parked():
                stream.feed.put(g.run(resume_request(g.request, i, g.parts[i]), i))

    def _collect(self, sample: RolloutSample, sender: "_Sender") -> None:
        group = next((g for g in self._held.values() if sample.request_id in g.running), None)
        if group is None:  # an abandoned attempt's sample (aborted or finished late): never sent
            return
        request_id = sample.request_id
        index = group.running[request_id]
        index = sample.sample_index if index is None else index
        group.outstanding[request_id] -= 1
        if not group.outstanding[request_id]:
            del group.running[request_id], group.outstanding[request_id]
        self._tokens += int(sample.token_ids.numel())
        parts = group.parts.setdefault(index, [])
        parts.append(sample)
        if sample.finish_reason == INTERRUPTED:
            return
        self._samples += 1
        group.samples.append(join(group.request, index, group.parts.pop(index)))
        if len(group.samples) == group.request.sampling.n:
            with self._held_lock:
                del self._held[group.lease.lease_id]
            sender.submit(group)

    def _abandon_lost(self, stream: "_EngineStream | None") -> None:
        with self._held_lock:
            lost, self._lost = self._lost, set()
            groups = [self._held.pop(i) for i in lost if i in self._held]
            for i in lost:
                if self._alone.get(i) is False:  # still waiting to run: dropped (a running one finishes unsent)
                    del self._alone[i]
        for g in groups:
            if stream is not None:
                for request_id in g.running:
                    self.engine.abort(request_id)

    def _run_alone(self, lease: Lease) -> None:
        """A probe or an evaluation on the idle engine, its lease renewed meanwhile; skipped if it was lost while it
        waited (requeued: the queue grants it again)."""
        with self._held_lock:
            if lease.lease_id not in self._alone:
                return
            self._alone[lease.lease_id] = True
        try:
            if isinstance(lease.task, ProbeTask):
                self._probe(lease)
            else:
                self._evaluate(lease)
        finally:
            with self._held_lock:
                self._alone.pop(lease.lease_id, None)

    def _probe(self, lease: Lease) -> None:
        """Sparse, then dense, on the same requests and an otherwise idle engine; nothing is sent."""
        task: ProbeTask = lease.task
        requests = [self._requests(GroupTask(task.step, r)) for r in task.records]
        with self._engine_lock:
            result = measure_speedup(self.engine, requests, self._probed_modes)
        self._complete(lease, result)

    def _evaluate(self, lease: Lease) -> None:
        """The held-out prompts in each mode (dense, and sparse under the schedule in force); scored, not sent."""
        task: EvalTask = lease.task
        s = self.config.rollout.sampling
        sampling = SamplingParams(max_tokens=s.max_tokens, temperature=0.0 if task.greedy else s.temperature,
                                  n=task.samples, logprobs=0)
        requests = [RolloutRequest(f"{r.prompt_id}-v{task.version}", tuple(render_prompt(
            self.tokenizer, r.messages, self.config.data.chat_template)), replace(sampling, seed=stable_seed(
                self.config.run.seed, r.index, 5))) for r in task.records]
        by_id = {req.request_id: r for req, r in zip(requests, task.records)}
        results = []
        with self._engine_lock:
            schedule = self.engine.schedule
            for mode in task.modes:
                self.engine.set_schedule(None if mode == "dense" else schedule)
                start = time.perf_counter()
                samples = self.engine.generate(requests)
                results.append(self._score_eval(mode, samples, by_id, time.perf_counter() - start))
            self.engine.set_schedule(schedule)
        self._complete(lease, EvalRecord(task.version, len(task.records), "greedy" if task.greedy else "sampled",
                                         self.engine.schedule_version, results))

    def _score_eval(self, mode: str, samples, records: dict, seconds: float) -> EvalResult:
        rewards, lengths = [], []
        for x in samples:
            if x.finish_reason == "error":
                continue
            record = records[x.request_id]
            text = self.tokenizer.decode(x.token_ids.tolist(), skip_special_tokens=True)
            meta = reward_metadata(record, -1, x.sample_index, x.finish_reason, f"{x.request_id}#{x.sample_index}")
            rewards.append(self.reward(text, record.answer, x.finish_reason, meta))
            lengths.append(int(x.token_ids.numel()))
        correct = self.config.reward.correct
        return EvalResult(
            mode=mode, accuracy=statistics.fmean(r >= correct for r in rewards) if rewards else None,
            reward_mean=statistics.fmean(rewards) if rewards else None,
            response_length_mean=statistics.fmean(lengths) if lengths else None,
            samples=len(samples), tokens=sum(lengths), seconds=seconds,
        )

    def _complete(self, lease: Lease, result) -> bool:
        try:
            self._dispatcher.complete(self.worker_id, lease.lease_id, result, self._engine_time())
            return True
        except LeaseError:
            return False

    def _heartbeat(self) -> None:
        """Renew the held leases while the engine makes progress; learn which ones were lost."""
        try:
            self._renew_while_serving()
        except BaseException as exc:  # re-raised on the serving thread: a worker that cannot renew must not serve
            self._heartbeat_error = exc

    def _renew_while_serving(self) -> None:
        interval = self.config.run.recovery.lease_timeout_s / 4
        tokens = -1
        while not self._stop.wait(interval):
            with self._held_lock:
                ids = [*self._held, *self._alone]
                running_alone = any(self._alone.values())
            now_tokens = self.engine.counters().tokens_generated
            if ids and now_tokens == tokens and (running_alone or self._engine_busy()):
                continue  # no progress since the last beat: let the leases run out (parked groups wait for a sync)
            tokens = now_tokens
            lost = self._dispatcher.renew(self.worker_id, ids, self._engine_time())
            if lost:
                with self._held_lock:
                    self._lost.update(lost)


def _handle_version(handle) -> int:
    from sparrow.weight_sync import Manifest

    return Manifest.from_json(handle.manifest_json).version


class _EngineStream:
    """One open `engine.stream(feed)` on its own thread; finished samples come out of a queue."""

    def __init__(self, worker: RolloutWorker):
        self.worker = worker
        worker._engine_lock.acquire()
        self.feed = RequestFeed()
        self.out: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        async def consume():
            async for sample in self.worker.engine.stream(self.feed):
                self.out.put(sample)

        try:
            asyncio.run(consume())
        except BaseException as exc:  # re-raised on the serving thread
            self.out.put(exc)
        finally:
            self.out.put(_DONE)

    def finished(self) -> list[RolloutSample]:
        out = []
        while True:
            try:
                item = self.out.get_nowait()
            except queue.Empty:
                return out
            if item is _DONE:
                return out
            if isinstance(item, BaseException):
                raise item
            out.append(item)

    def close(self) -> None:
        self.feed.close()
        self.thread.join()
        self.worker._engine_lock.release()
        self.finished()


class _Sender:
    """Scores finished groups and sends them to the trainer on a thread of its own, so the engine
    keeps generating while rewards are computed and samples travel."""

    def __init__(self, worker: RolloutWorker):
        self.worker = worker
        self.todo: queue.Queue = queue.Queue()
        self.pending = 0
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="sender", daemon=True)
        self.thread.start()

    @property
    def idle(self) -> bool:
        return self.pending == 0

    def submit(self, group: _Group) -> None:
        self.pending += 1
        self.todo.put(group)

    def _run(self) -> None:
        while (group := self.todo.get()) is not None:
            try:
                self._send(group)
            except TransportError as exc:  # the trainer is gone: its lease runs out and the group is redone
                log.warning("%s: group %s not sent (%s); its lease runs out and it is generated again",
                            self.worker.worker_id, group.request.request_id, exc)
            except BaseException as exc:
                self.errors.append(exc)
            finally:
                self.pending -= 1

    def _send(self, group: _Group) -> None:
        w = self.worker
        task = group.lease.task
        trajectories, failed = [], 0
        for s in sorted(group.samples, key=lambda s: s.sample_index):
            t = Trajectory.of(s, worker_id=w.worker_id)
            if s.finish_reason == "error":
                failed += 1
            else:
                text = w.tokenizer.decode(s.token_ids.tolist(), skip_special_tokens=True)
                meta = reward_metadata(task.record, task.step, s.sample_index, s.finish_reason, t.sample_id)
                t.reward = w.reward(text, task.record.answer, s.finish_reason, meta)
            trajectories.append(t)
        w.metrics.record_samples(trajectories)
        report = w.client.send(trajectories)
        rejected = {r.id for r in report.rejected}
        result = GroupReport(
            worker=w.worker_id, samples=len(trajectories), failed=failed,
            tokens=sum(int(s.token_ids.numel()) for s in group.samples), accepted=report.accepted,
            duplicate=report.duplicate, rejected=[(r.id, r.field, r.message) for r in report.rejected],
            streams=report.streams, sample_ids=[t.sample_id for t in trajectories if t.sample_id not in rejected],
            seconds=time.perf_counter() - group.started,
        )
        w._complete(group.lease, result)

    def raise_errors(self) -> None:
        if self.errors:
            raise self.errors[0]

    def close(self) -> None:
        self.todo.put(None)
        self.thread.join(timeout=60)
