"""`RolloutFleet`: the rollout workers kept alive, in sync and at the requested size.

The driver calls `check()` a few times a second while it waits for rollouts. It

- notices a worker whose `serve` call failed (actor crash, process killed, node removed): its
  leases go back to the queue, and a replacement actor is started in the worker's slot (bounded
  restarts per slot; past the bound the job stops naming the worker and its last error);
- notices a worker whose leases expired (it stopped renewing): if it does not answer a liveness
  probe within `hung_worker_timeout_s` it is killed and replaced like a dead one;
- notices a new worker that does not serve within `join_timeout_s` of its start (its engine's
  start-up hangs) and replaces it in turn;
- brings up new workers without blocking: a replacement or an added worker is given the trajectory
  address, the schedule in force and the current weights in its `serve` call, and only leases work
  once it holds them (the dispatcher's admission control checks its policy version);
- applies a requested pool size: growing adds slots, shrinking retires the newest workers (they
  lease nothing more, finish what they hold, then leave).

Every recovery is a `FaultEvent` with the seconds from detection until the replacement served; it is
listed in `resolved` when it completes.
"""

import time
from dataclasses import dataclass

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError

from sparrow.coordinator.transport import PoolStatus
from sparrow.schedule import SparsitySchedule

from .config import SparrowConfig
from .pools import RolloutPool, SharedBundles, WorkerSlot
from .step_record import FaultEvent


class JobFailed(RuntimeError):
    """A failure the job cannot recover from; the message names the component and its last error."""


@dataclass
class WorkerSetup:
    """What a (new) worker needs before it leases work."""

    trajectory_address: str
    schedule: SparsitySchedule
    """The job's schedule in force: a new worker's engine starts with it (an engine that fixes its kernels when it
    starts, as vLLM's full decode graphs do, must start sparse to run sparse)."""
    weights: object | None
    """A `WeightHandle` of the current version (None while the initial weights are current, or while the channel
    hands versions over another way: then the driver sends a joiner the current one, `Publication.for_joiners`)."""
    version: int = 0
    """The job's policy version: a worker has joined once it serves this one, not merely once it serves."""


@dataclass
class _Recovery:
    event: FaultEvent
    started: float
    slot: int
    spawned: float | None = None
    """When the slot's current actor was started (None while its bundle waits for placement)."""


class RolloutFleet:
    def __init__(self, config: SparrowConfig, model: str, credentials, dispatcher, log, scrape_targets=None,
                 shared: SharedBundles | None = None):
        self.config, self.dispatcher, self.log = config, dispatcher, log
        self.scrape_targets = scrape_targets
        """`metrics.ScrapeTargets` kept in step with the serving workers (None: metrics off)."""
        self.recovery = config.run.recovery
        self.pool = RolloutPool(config, model, credentials, shared)
        self.target = config.rollout.pool.size
        self.setup: WorkerSetup | None = None
        self.resolved: list[FaultEvent] = []
        """Recoveries (and resizes) in the order they completed; the driver logs each once, in its step record."""
        self._recovering: dict[int, _Recovery] = {}
        self._retiring: set[int] = set()
        self._waiting_placement: set[int] = set()
        self.step = 0
        """The step the driver is on, for the events."""
        self.membership_changed = False
        """Set when workers join or leave (a collective weight group must be rebuilt)."""

    # ------------------------------------------------------------------ start and stop

    def spawn(self, schedule: SparsitySchedule) -> None:
        """Create the initial workers without waiting: their engines load (with the job's `schedule`) while the
        driver starts the rest."""
        for _ in range(self.target):
            self.pool.spawn(self.pool.add_slot(wait_s=self.config.rollout.pool.ready_timeout_s), schedule)

    def start(self, setup: WorkerSetup) -> None:
        """Wait until every initial worker has loaded (errors surface here, at start; `spawn` first if not yet),
        then let each serve."""
        self.setup = setup
        if not self.pool.slots:
            self.spawn(setup.schedule)
        slots = list(self.pool.slots.values())
        self.workers = ray.get([slot.actor.info.remote() for slot in slots])
        for slot, info in zip(slots, self.workers):
            self._announce(info)
            self._serve(slot)

    def _serve(self, slot: WorkerSlot) -> None:
        slot.serving = slot.actor.serve.remote(self.dispatcher, self.setup)

    def _announce(self, info: dict) -> None:
        if self.scrape_targets is not None:
            self.scrape_targets.set(info["worker_id"], "rollout", info["metrics_url"])

    def _retract(self, slot: WorkerSlot) -> None:
        if self.scrape_targets is not None:
            self.scrape_targets.remove(slot.worker_id)

    def shutdown(self) -> None:
        live = [s.actor for s in self.pool.slots.values() if s.actor is not None]
        for actor in live:
            actor.stop.remote()
        try:
            ray.get([a.shutdown.remote() for a in live], timeout=60)
        except RayError as exc:
            self.log(f"shutdown: {exc.__class__.__name__}: {exc}")
        self.pool.shutdown()

    @property
    def live(self) -> list[WorkerSlot]:
        """Workers serving now (a replacement counts once it has taken the job's state)."""
        return [s for s in self.pool.slots.values() if s.serving is not None and s.index not in self._recovering]

    @property
    def reachable(self) -> list[WorkerSlot]:
        """Workers with an actor: the serving ones and those still joining (they must get new weights too)."""
        return [s for s in self.pool.slots.values() if s.serving is not None]

    @property
    def joining(self) -> list[WorkerSlot]:
        return [s for s in self.reachable if s.index in self._recovering]

    @property
    def actors(self) -> list:
        return [s.actor for s in self.pool.live]

    # ------------------------------------------------------------------ supervision

    def check(self) -> None:
        self._find_failed()
        self._find_hung()
        self._advance_recoveries()
        self._apply_size()

    def _find_failed(self) -> None:
        refs = {s.serving: s for s in self.pool.slots.values() if s.serving is not None}
        if not refs:
            return
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
        for ref in done:
            slot = refs[ref]
            try:
                ray.get(ref)
                error = "serve returned while the job runs"
            except RayActorError as exc:
                error = f"actor died: {describe(exc)}"
            except RayError as exc:
                error = describe(exc)
            if slot.index in self._retiring:
                self._retract(slot)
                self.pool.remove(slot)
                self._retiring.discard(slot.index)
                self.membership_changed = True
                continue
            self._replace(slot, "rollout_worker_lost", error)

    def _find_hung(self) -> None:
        expired = ray.get(self.dispatcher.take_expired.remote())
        for worker in sorted({lease.worker for lease in expired}):
            slot = next((s for s in self.pool.slots.values() if s.worker_id == worker and s.serving is not None), None)
            if slot is None or slot.index in self._recovering:
                continue
            try:
                ray.get(slot.actor.progress.remote(), timeout=self.recovery.hung_worker_timeout_s)
                self.log(f"step {self.step + 1}: {worker} let {sum(l.worker == worker for l in expired)} leases expire; "
                         "they were requeued, or left to another worker's running attempt (the worker answers, so it "
                         "keeps serving)")
            except (GetTimeoutError, RayError) as exc:
                self._replace(slot, "rollout_lease_expired", f"stopped renewing its leases and did not answer: {describe(exc)}")

    def _replace(self, slot: WorkerSlot, kind: str, error: str) -> None:
        lost = ray.get(self.dispatcher.release.remote(slot.worker_id))
        slot.restarts += 1
        slot.last_error = error
        self.membership_changed = True
        self.log(f"step {self.step + 1}: {slot.worker_id} lost ({error}); {len(lost)} leased groups requeued (or left to "
                 f"another worker's running attempt); "
                 f"restart {slot.restarts} of {self.recovery.max_worker_restarts}")
        if slot.restarts > self.recovery.max_worker_restarts:
            raise JobFailed(f"{slot.worker_id} failed {slot.restarts} times (run.recovery.max_worker_restarts="
                            f"{self.recovery.max_worker_restarts}); last error: {error}")
        self.pool.kill(slot)
        self._retract(slot)
        if slot.index not in self._recovering:  # a replacement that never served keeps the first event and its clock
            event = FaultEvent(kind, slot.worker_id, f"{error}; {len(lost)} leased groups given up", None, self.step)
            self._recovering[slot.index] = _Recovery(event, time.monotonic(), slot.index)
        self._bring_up(slot)

    def _bring_up(self, slot: WorkerSlot) -> None:
        """Spawn into the slot if its bundle is placed; otherwise wait for capacity (the pool runs smaller)."""
        if self.pool.ready(slot):
            self._waiting_placement.discard(slot.index)
            self.pool.spawn(slot, self.setup.schedule)
            self._serve(slot)
            if slot.index in self._recovering:
                self._recovering[slot.index].spawned = time.monotonic()
        else:
            if slot.index not in self._waiting_placement:
                free = {k: round(v, 2) for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
                self.log(f"{slot.worker_id}: no capacity for its bundle {self.pool.pool.bundle()} (free now: {free}); "
                         "the pool runs without it until a node can take it")
            self._waiting_placement.add(slot.index)

    def _advance_recoveries(self) -> None:
        for index, rec in list(self._recovering.items()):
            slot = self.pool.slots.get(index)
            if slot is None:
                del self._recovering[index]
                continue
            if slot.actor is None:
                self._bring_up(slot)
                continue
            ready, _ = ray.wait([slot.actor.progress.remote()], timeout=0.5)
            progress = ray.get(ready[0]) if ready else {"serving": False}
            if progress["serving"] and progress["policy_version"] != self.setup.version:
                continue  # started, waiting for the current version; it leases nothing admissible until then
            if progress["serving"]:
                rec.event.recovery_seconds = time.monotonic() - rec.started
                self.resolved.append(rec.event)
                self._announce(ray.get(slot.actor.info.remote()))
                self.log(f"step {self.step + 1}: {slot.worker_id} replaced and serving after {rec.event.recovery_seconds:.1f} s")
                del self._recovering[index]
            elif rec.spawned is not None and time.monotonic() - rec.spawned > self.recovery.join_timeout_s:
                self._replace(slot, rec.event.kind, f"started {time.monotonic() - rec.spawned:.0f} s ago and not serving "
                              f"(run.recovery.join_timeout_s={self.recovery.join_timeout_s:g})")

    # ------------------------------------------------------------------ elastic size

    def resize(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"rollout pool size {size}: must be >= 1")
        if self.pool.shared is not None and size != self.target:
            raise ValueError(f"rollout pool size {size}: a colocated placement pairs each rollout worker with a trainer "
                             f"rank on its GPU, so the pool stays at {self.target}")
        self.target = size

    def _apply_size(self) -> None:
        active = [s for s in self.pool.slots.values() if s.index not in self._retiring]
        if len(active) < self.target:
            for _ in range(self.target - len(active)):
                slot = self.pool.add_slot()
                event = FaultEvent("pool_resized", slot.worker_id, f"added (target {self.target})", None, self.step)
                self._recovering[slot.index] = _Recovery(event, time.monotonic(), slot.index)
                self._bring_up(slot)
            self.membership_changed = True
        elif len(active) > self.target:
            for slot in sorted(active, key=lambda s: -s.index)[: len(active) - self.target]:
                ray.get(self.dispatcher.retire.remote(slot.worker_id))
                self.resolved.append(FaultEvent("pool_resized", slot.worker_id, f"retired (target {self.target})", 0.0, self.step))
                if slot.actor is None:  # never placed: nothing to wait for
                    self.pool.remove(slot)
                    continue
                slot.actor.stop.remote()
                self._retiring.add(slot.index)

    def status(self) -> PoolStatus:
        """The pool as `sparrow pool status` shows it."""
        joining = len(self._recovering)
        serving = sum(1 for s in self.live if s.index not in self._retiring)
        return PoolStatus("rollout", self.target, serving, joining, len(self._retiring), True)

    # ------------------------------------------------------------------ weights, schedule, connection

    def broadcast(self, method: str, *args) -> list:
        """Call `method` on every worker and wait; workers that died meanwhile are skipped (check() replaces them)."""
        return settled(self.submit(method, *args))

    def submit(self, method: str, *args, slots: list[WorkerSlot] | None = None) -> list:
        """Call `method` on `slots` (default: every worker, joining ones included); the refs."""
        return [getattr(s.actor, method).remote(*args) for s in (self.reachable if slots is None else slots)]

    def progress(self) -> list[dict]:
        """Best effort: the reports that arrive within a second; any failed one is skipped, not only a lost actor's."""
        refs = [s.actor.progress.remote() for s in self.live]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=1.0)
        return settled(ready, skip=RayError)


def describe(exc: BaseException) -> str:
    """One line for a failure: the remote exception itself, not Ray's task header."""
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    text = str(exc).strip().splitlines()
    return f"{exc.__class__.__name__}: {text[-1]}" if text else exc.__class__.__name__


def settled(refs: list, skip: type[Exception] = RayActorError) -> list:
    """Results of the refs whose actors are still alive (a worker lost meanwhile is replaced by `RolloutFleet.check`);
    a ref failing with `skip` is left out."""
    out = []
    for ref in refs:
        try:
            out.append(ray.get(ref))
        except skip:
            continue
    return out
