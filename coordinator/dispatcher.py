"""`Dispatcher`: the job's `WorkQueue` as a Ray actor, so rollout workers can pull from it.

The driver adds steps and takes completed ones; workers lease, renew and complete. Every call first
expires overdue leases, so a worker that stopped renewing loses its groups within one lease timeout
of the next call from anyone (workers call several times a second while generating). Threaded
actor: calls run concurrently and the queue is guarded by one lock.
"""

import threading
import time

import ray

from .data import PromptRecord
from .metrics.throughput import EngineTime
from .step_record import EvalRecord, GroupReport
from .work_queue import EvalTask, Lease, ProbeResult, StepWork, WorkQueue


class Dispatcher:
    def __init__(self, max_staleness: int, lease_timeout_s: float, speculate_after_s: float | None = None,
                 carry_staleness: int | None = None, budget_carry: int | None = None):
        self.queue = WorkQueue(max_staleness, lease_timeout_s, speculate_after_s, carry_staleness)
        self.budget_carry = budget_carry
        """Most groups a step closed by its time budget may carry (`RunConfig.budget_carry`)."""
        self._lock = threading.Lock()
        self.expired: list[Lease] = []
        """Leases that timed out since the driver last asked (`take_expired`)."""

    def _now(self) -> float:
        now = time.monotonic()
        self.expired += self.queue.expire(now)
        return now

    # the driver
    def add_step(self, step: int, records: list[PromptRecord], probe: list[PromptRecord], needed: int | None = None) -> None:
        with self._lock:
            self._now()
            self.queue.add_step(step, records, probe, needed)

    def add_eval(self, task: EvalTask) -> None:
        with self._lock:
            self.queue.add_eval(task)

    def take_eval(self, version: int) -> EvalRecord | None:
        with self._lock:
            self._now()
            return self.queue.take_eval(version)

    def progress(self, step: int, over_budget: bool = False) -> tuple[int, int, bool]:
        """(groups done, groups in the step, whether it may close) of a queued step; `over_budget`: the trainer has
        waited its time budget for it."""
        with self._lock:
            self._now()
            work = self.queue.steps[step]
            return len(work.done), work.groups, self.queue.step_complete(step, self._budget_carry(over_budget))

    def take_step(self, step: int, over_budget: bool = False) -> StepWork:
        with self._lock:
            return self.queue.take_step(step, self._budget_carry(over_budget))

    def _budget_carry(self, over_budget: bool) -> int | None:
        return self.budget_carry if over_budget else None

    def take_expired(self) -> list[Lease]:
        with self._lock:
            self._now()
            out, self.expired = self.expired, []
            return out

    def release(self, worker: str) -> list[Lease]:
        with self._lock:
            return self.queue.release(worker)

    def retire(self, worker: str) -> None:
        with self._lock:
            self.queue.retire(worker)

    def holds(self, worker: str) -> int:
        with self._lock:
            self._now()
            return len(self.queue.holds(worker))

    def discard_from(self, step: int) -> int:
        with self._lock:
            return len(self.queue.discard_from(step))

    def engine_time(self) -> dict[str, EngineTime]:
        """Each worker's latest engine-time report (the step loop's utilisation and batch shape)."""
        with self._lock:
            return {w: s.engine for w, s in self.queue.workers.items()}

    # the workers
    def lease(self, worker: str, policy_version: int, max_groups: int, engine: EngineTime) -> list[Lease]:
        with self._lock:
            return self.queue.lease(worker, policy_version, max_groups, self._now(), engine)

    def renew(self, worker: str, lease_ids: list[int], engine: EngineTime) -> list[int]:
        with self._lock:
            return self.queue.renew(worker, lease_ids, self._now(), engine)

    def complete(self, worker: str, lease_id: int, result: GroupReport | ProbeResult | EvalRecord, engine: EngineTime) -> None:
        with self._lock:
            self.queue.complete(worker, lease_id, result, self._now(), engine)


class DispatcherClient:
    """A worker's calls on the dispatcher, whether it is the job's Ray actor or a plain `Dispatcher`
    (one process: tests, or a worker used directly)."""

    def __init__(self, dispatcher):
        self.dispatcher = dispatcher
        self.remote = isinstance(dispatcher, ray.actor.ActorHandle)

    def _call(self, name: str, *args):
        method = getattr(self.dispatcher, name)
        return ray.get(method.remote(*args)) if self.remote else method(*args)

    def lease(self, worker: str, policy_version: int, max_groups: int, engine: EngineTime) -> list[Lease]:
        return self._call("lease", worker, policy_version, max_groups, engine)

    def renew(self, worker: str, lease_ids: list[int], engine: EngineTime) -> list[int]:
        return self._call("renew", worker, lease_ids, engine)

    def complete(self, worker: str, lease_id: int, result: GroupReport | ProbeResult | EvalRecord, engine: EngineTime) -> None:
        self._call("complete", worker, lease_id, result, engine)
