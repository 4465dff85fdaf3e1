"""`WorkQueue`: the GRPO groups of the steps in flight, leased to rollout workers (pure bookkeeping).

Pull, not push: a worker leases groups as it has room for them, so a fast worker takes more and one
worker's long tail no longer idles the pool. A lease is renewed while its worker generates; one not
renewed within `lease_timeout_s`, or whose worker is lost, goes back to the queue as a new
**attempt**. An attempt's number is part of its request id and so of its sample ids, and the
trainer takes exactly the ids of completed attempts: samples of an abandoned attempt can never be
trained, and attempts are never reused (not even after a rollback), so no id is acknowledged twice.

Speculation (`speculate_after_s`, off by default): a worker with nothing to do, when nothing is pending, is
given a new attempt of a group another worker has held that long (the oldest first, one backup a group), the
way MapReduce backs up its stragglers. The first attempt to complete is the group's result; the other's lease
is withdrawn, so its worker aborts it (`renew`) or has its result refused (`complete`), and its samples are
never trained. A slow worker then no longer holds a step back by the groups it leased.

Admission control (staleness s): a worker at policy version v may lease a group of step j only if
j − s ≤ v ≤ j. Together with "step j is trained at step j" this bounds every trained sample's
staleness by s, whichever worker generated it and however often it was retried.

Partial rollouts (`carry_staleness`, off by default): a step may be given more groups than it trains
(`needed`); it closes once `needed` are done, trains the first `needed` to complete, and its other groups — done,
generating, or not started — carry over to the next step, leases and attempts unchanged (the worker holding one
interrupts it at its next weight change and resumes it, `sparrow.rollout_workers.resume`). A group's **home** is
the step it now counts toward. Bound: a group leased at policy version v that would be trained after step
`v + carry_staleness` holds its step open until it is done, so no trained sample's oldest token is more than
`carry_staleness` versions behind the policy that trains it.

Time budget (`budget_carry`, passed by the driver once a step's rollouts have run `run.partial_rollout.close_after_s`):
the step may close with fewer than `needed` groups done (at least one), training those and carrying the rest, as
long as it leaves at most `budget_carry` groups to the next step; so the job never falls more than that behind
its data, and a step that would waits for its groups as without a budget.

Times are passed in (`now`), so the bookkeeping is deterministic and unit-testable.
"""

import math
from collections import OrderedDict
from dataclasses import dataclass, field

from .data import PromptRecord
from .metrics.throughput import EngineTime
from .step_record import EvalRecord, GroupReport


@dataclass(frozen=True)
class GroupTask:
    step: int
    record: PromptRecord
    attempt: int = 0

    @property
    def group(self) -> tuple[int, str]:
        """The GRPO group this attempt generates (its step and prompt), shared by all its attempts."""
        return self.step, self.record.prompt_id

    @property
    def request_id(self) -> str:
        """The engine request id (sample ids are `<request_id>#<sample index>`); attempt 0 keeps the prompt id."""
        return self.record.prompt_id if self.attempt == 0 else f"{self.record.prompt_id}.r{self.attempt}"


@dataclass(frozen=True)
class ProbeTask:
    """Decode these prompts sparse and dense on one otherwise idle engine (nothing is sent): the measured speedup."""

    step: int
    records: tuple[PromptRecord, ...]


@dataclass(frozen=True)
class EvalTask:
    """Score the held-out prompts with policy `version` exactly, in each mode, on an otherwise idle engine
    (nothing is sent or trained); the dispatcher hands it to a worker serving that version."""

    version: int
    records: tuple[PromptRecord, ...]
    modes: tuple[str, ...]
    samples: int
    greedy: bool


@dataclass(frozen=True)
class ProbeResult:
    sparse_tokens_per_s: float
    dense_tokens_per_s: float

    @property
    def speedup(self) -> float:
        return self.sparse_tokens_per_s / self.dense_tokens_per_s


@dataclass
class Lease:
    lease_id: int
    task: GroupTask | ProbeTask | EvalTask
    worker: str
    expires: float
    granted: float
    policy_version: int = 0
    """The worker's policy version when granted: a group's tokens are no older than it."""

    @property
    def exclusive(self) -> bool:
        """A probe or an evaluation: run alone on an idle engine, between streams."""
        return not isinstance(self.task, GroupTask)


@dataclass
class StepWork:
    step: int
    groups: int
    """Groups this step trains (`needed`); more may be queued (spares, groups carried in)."""
    pending: "OrderedDict[str, GroupTask]" = field(default_factory=OrderedDict)
    done: dict[str, tuple[GroupTask, GroupReport]] = field(default_factory=dict)
    probe: ProbeTask | None = None
    probe_leased: bool = False
    probe_result: ProbeResult | None = None
    requeued: int = 0
    speculated: int = 0
    """Groups given to a second worker while the first still held them (`speculate_after_s`)."""
    abandoned: list[str] = field(default_factory=list)
    """Request ids of the attempts given up (lease lost or expired, or a speculative twin withdrawn): none of their
    samples is trained."""
    first_lease: float | None = None
    last_done: float | None = None
    carried_in: int = 0
    """Groups a previous step handed over (partial rollouts)."""
    leased_at: dict[str, int] = field(default_factory=dict)
    """Per group done: the policy version its completing attempt was leased at."""
    carried_out: int = 0
    """This step's groups handed to the next step when it closed: done, generating or not started."""
    carried_requests: list[str] = field(default_factory=list)
    """The request ids among them whose samples may still reach the trainer (done, or leased and generating)."""

    closed_by_budget: bool = False
    """Closed by the time budget with fewer than `groups` done."""

    @property
    def complete(self) -> bool:
        return len(self.done) >= self.groups and self.probed

    @property
    def probed(self) -> bool:
        return self.probe is None or self.probe_result is not None


@dataclass
class EvalWork:
    task: EvalTask
    leased: bool = False
    result: EvalRecord | None = None


@dataclass
class WorkerState:
    last_seen: float
    engine: EngineTime = EngineTime()
    """Its latest report (the one with the most busy seconds: reports may arrive out of order)."""
    retiring: bool = False


class LeaseError(RuntimeError):
    """A call about a lease the queue does not hold for that worker (expired, requeued, or another's)."""


class WorkQueue:
    def __init__(self, max_staleness: int, lease_timeout_s: float, speculate_after_s: float | None = None,
                 carry_staleness: int | None = None):
        if max_staleness < 0 or lease_timeout_s <= 0:
            raise ValueError(f"max_staleness={max_staleness} must be >= 0 and lease_timeout_s={lease_timeout_s} > 0")
        if speculate_after_s is not None and speculate_after_s <= 0:
            raise ValueError(f"speculate_after_s={speculate_after_s} must be > 0 (or None: no speculation)")
        if carry_staleness is not None and carry_staleness <= max_staleness:
            raise ValueError(f"carry_staleness={carry_staleness} must exceed max_staleness={max_staleness} (a carried "
                             "group trains at least one step later than it could without carrying)")
        self.max_staleness, self.lease_timeout_s = max_staleness, lease_timeout_s
        self.speculate_after_s = speculate_after_s
        self.carry_staleness = carry_staleness
        self.home: dict[tuple[int, str], int] = {}
        """Carried groups (their step and prompt) -> the step they now count toward; others count toward their own."""
        self.steps: dict[int, StepWork] = {}
        self.evals: dict[int, EvalWork] = {}
        """Evaluations by the policy version they score."""
        self.leases: dict[int, Lease] = {}
        self.workers: dict[str, WorkerState] = {}
        self._next_lease = 0
        self._attempts: dict[str, int] = {}
        """Highest attempt handed out per prompt id, kept across rollbacks so no request id repeats."""

    # ------------------------------------------------------------------ the coordinator's side

    def add_step(self, step: int, records: list[PromptRecord], probe: list[PromptRecord] = (),
                 needed: int | None = None) -> None:
        """Queue a step's groups; it trains `needed` of them (default: all; fewer only with partial rollouts)."""
        needed = len(records) if needed is None else needed
        if step in self.steps and self.steps[step].groups:
            raise ValueError(f"step {step} is already queued")
        if needed < len(records) and self.carry_staleness is None:
            raise ValueError(f"step {step}: {len(records)} groups for {needed} trained needs partial rollouts")
        work = self.steps.pop(step, None) or StepWork(step, 0)  # groups carried in wait in a placeholder
        work.groups, work.probe = needed, ProbeTask(step, tuple(probe)) if probe else None
        for r in records:
            task = GroupTask(step, r, self._new_attempt(r.prompt_id))
            work.pending[r.prompt_id] = task
        self.steps[step] = work

    def _home(self, task: GroupTask) -> int:
        return self.home.get(task.group, task.step)

    def _work_of(self, task) -> "StepWork | None":
        return self.steps.get(self._home(task) if isinstance(task, GroupTask) else task.step)

    def _new_attempt(self, prompt_id: str) -> int:
        attempt = self._attempts.get(prompt_id, -1) + 1
        self._attempts[prompt_id] = attempt
        return attempt

    def add_eval(self, task: EvalTask) -> None:
        if task.version in self.evals:
            raise ValueError(f"policy version {task.version} is already queued for evaluation")
        self.evals[task.version] = EvalWork(task)

    def take_eval(self, version: int) -> EvalRecord | None:
        """The evaluation of `version` once done (it leaves the queue), else None."""
        work = self.evals.get(version)
        if work is None or work.result is None:
            return None
        return self.evals.pop(version).result

    def step_complete(self, step: int, budget_carry: int | None = None) -> bool:
        """Whether `step` may close: its groups are done, or (`budget_carry`: its time budget ran out) at least one
        is and closing now leaves at most `budget_carry` groups to the next step; never while a group is held open."""
        work = self.steps[step]
        if not work.groups or self.held_open(step):
            return False
        return work.complete or (budget_carry is not None and self._closes_early(work, budget_carry))

    def _closes_early(self, work: StepWork, budget_carry: int) -> bool:
        if self.carry_staleness is None:
            raise ValueError(f"step {work.step}: a time budget close needs partial rollouts (carry_staleness)")
        if not work.done or not work.probed:
            return False
        return len(work.pending) + len({lease.task.group for lease in self._leased_at_home(work.step)}) <= budget_carry

    def _leased_at_home(self, step: int) -> list[Lease]:
        """Leases of groups that count toward `step` (its own, and groups carried into it)."""
        return [lease for lease in self.leases.values()
                if isinstance(lease.task, GroupTask) and self._home(lease.task) == step]

    def held_open(self, step: int) -> list[Lease]:
        """Leases of groups at home in `step` that may not carry over: trained later, their oldest tokens would be
        more than `carry_staleness` versions old."""
        if self.carry_staleness is None:
            return []
        return [lease for lease in self._leased_at_home(step) if step + 1 - lease.policy_version > self.carry_staleness]

    def take_step(self, step: int, budget_carry: int | None = None) -> StepWork:
        """A complete step's results; the step leaves the queue. With partial rollouts it trains the groups done
        that may not carry (the staleness bound) and then the first done, `groups` in all (fewer when the time
        budget closed it: all done); the rest carry over."""
        work = self.steps[step]
        if not self.step_complete(step, budget_carry):
            raise ValueError(f"step {step} is not complete: {len(work.done)} of {work.groups} groups done"
                             + (f", {len(self.held_open(step))} held open" if self.held_open(step) else ""))
        self.steps.pop(step)
        work.closed_by_budget = not work.complete
        if self.carry_staleness is not None:
            self._carry(work)
        for group in [g for g, home in self.home.items() if home == step]:
            del self.home[group]
        return work

    def _carry(self, work: StepWork) -> None:
        """Hand `work`'s groups beyond the ones it trains to the next step (a placeholder until that is queued)."""
        nxt = self.steps.setdefault(work.step + 1, StepWork(work.step + 1, 0))
        moved: set[tuple[int, str]] = set()
        must = [p for p in work.done if work.step + 1 - work.leased_at[p] > self.carry_staleness]
        trained = must + [p for p in work.done if p not in must][:max(work.groups - len(must), 0)]
        for prompt_id in [p for p in work.done if p not in trained]:
            task, report = work.done.pop(prompt_id)
            nxt.done[prompt_id] = (task, report)
            nxt.leased_at[prompt_id] = work.leased_at.pop(prompt_id)
            moved.add(task.group)
            work.carried_requests.append(task.request_id)
        while work.pending:
            prompt_id, task = work.pending.popitem(last=False)
            nxt.pending[prompt_id] = task
            moved.add(task.group)
        for lease in self._leased_at_home(work.step):
            moved.add(lease.task.group)
            work.carried_requests.append(lease.task.request_id)
        for group in moved:
            self.home[group] = nxt.step
        work.carried_out = len(moved)
        nxt.carried_in += len(moved)

    def discard_from(self, step: int) -> list[Lease]:
        """Forget steps >= `step` (a trainer rollback regenerates them), and the groups carried into them; their
        leases become invalid."""
        dropped = [lease for lease in self.leases.values()
                   if (self._home(lease.task) if isinstance(lease.task, GroupTask) else lease.task.step) >= step]
        for lease in dropped:
            del self.leases[lease.lease_id]
        self.home = {g: home for g, home in self.home.items() if home < step}
        for s in [s for s in self.steps if s >= step]:
            del self.steps[s]
        for v in [v for v in self.evals if v >= step]:
            del self.evals[v]
        return dropped

    def release(self, worker: str) -> list[Lease]:
        """A lost worker: its leases go back to the queue (new attempts) and it is forgotten."""
        self.workers.pop(worker, None)
        lost = [lease for lease in self.leases.values() if lease.worker == worker]
        for lease in lost:
            self._requeue(lease)
        return lost

    def retire(self, worker: str) -> None:
        """Lease nothing more to `worker` (the pool shrinks); its current leases run to completion."""
        if worker in self.workers:
            self.workers[worker].retiring = True

    def expire(self, now: float) -> list[Lease]:
        """Requeue every lease not renewed in time."""
        expired = [lease for lease in self.leases.values() if lease.expires <= now]
        for lease in expired:
            self._requeue(lease)
        return expired

    def _requeue(self, lease: Lease) -> None:
        del self.leases[lease.lease_id]
        owner = self._work_of(lease.task) if isinstance(lease.task, GroupTask) else None
        if owner is not None:
            owner.abandoned.append(lease.task.request_id)
        if isinstance(lease.task, GroupTask) and self._attempts_of(lease.task):
            return  # another worker's attempt of the same group (speculation) still runs: it is the group's now
        if isinstance(lease.task, EvalTask):
            if lease.task.version in self.evals:
                self.evals[lease.task.version].leased = False
            return
        work = self._work_of(lease.task)
        if work is None:
            return
        task = lease.task
        if isinstance(task, ProbeTask):
            work.probe_leased = False
            return
        retry = GroupTask(task.step, task.record, self._new_attempt(task.record.prompt_id))
        work.pending[task.record.prompt_id] = retry
        work.pending = OrderedDict(sorted(work.pending.items(), key=lambda item: item[1].record.index))
        work.requeued += 1

    # ------------------------------------------------------------------ the workers' side

    def lease(self, worker: str, policy_version: int, max_groups: int, now: float,
              engine: EngineTime = EngineTime()) -> list[Lease]:
        """Up to `max_groups` admissible groups (oldest step first), or, to an idle worker, one evaluation of
        exactly its version or one probe.

        A worker holds at most its fair share of the admissible groups not yet done (split over the
        workers seen within a lease timeout), so the first worker to ask does not take everything, and
        one that finishes early takes more of what is left. With speculation on, an idle worker that
        finds nothing pending gets backups of other workers' long-held groups (`_backups`).
        """
        state = self._seen(worker, now, engine)
        if state.retiring:
            return []
        admissible = [w for s, w in sorted(self.steps.items()) if s - self.max_staleness <= policy_version <= s]
        idle = not any(lease.worker == worker for lease in self.leases.values())
        evaluation = self.evals.get(policy_version)
        if idle and evaluation is not None and not evaluation.leased and evaluation.result is None:
            evaluation.leased = True
            return [self._grant(None, evaluation.task, worker, now)]
        for work in admissible:
            if idle and work.probe is not None and not work.probe_leased and work.probe_result is None:
                work.probe_leased = True
                return [self._grant(work, work.probe, worker, now)]
        steps = {w.step for w in admissible}
        leased = [lease for lease in self.leases.values()
                  if isinstance(lease.task, GroupTask) and self._home(lease.task) in steps]
        outstanding = sum(len(w.pending) for w in admissible) + len(leased)
        active = sum(1 for s in self.workers.values() if not s.retiring and now - s.last_seen < self.lease_timeout_s)
        mine = sum(lease.worker == worker for lease in leased)
        share = min(max_groups, math.ceil(outstanding / max(active, 1)) - mine)
        out: list[Lease] = []
        for work in admissible:
            while work.pending and len(out) < share:
                _, task = work.pending.popitem(last=False)
                out.append(self._grant(work, task, worker, now, policy_version))
        if not out and idle and self.speculate_after_s is not None and not any(w.pending for w in admissible):
            out = self._backups(worker, steps, max_groups, now, policy_version)
        return out

    def _backups(self, worker: str, steps: set[int], max_groups: int, now: float, policy_version: int) -> list[Lease]:
        """New attempts, for an idle `worker`, of groups other workers have held `speculate_after_s` or longer."""
        held: dict[tuple[int, str], list[Lease]] = {}
        for lease in self.leases.values():
            if isinstance(lease.task, GroupTask) and self._home(lease.task) in steps:
                held.setdefault(lease.task.group, []).append(lease)
        candidates = sorted((leases[0] for leases in held.values()
                             if len(leases) == 1 and leases[0].worker != worker
                             and now - leases[0].granted >= self.speculate_after_s),
                            key=lambda lease: lease.granted)
        out = []
        for lease in candidates[:max_groups]:
            work = self._work_of(lease.task)
            task = GroupTask(lease.task.step, lease.task.record, self._new_attempt(lease.task.record.prompt_id))
            out.append(self._grant(work, task, worker, now, policy_version))
            work.speculated += 1
        return out

    def _attempts_of(self, task: GroupTask) -> list[Lease]:
        """The leases held on `task`'s group (its step and prompt), whatever their attempt."""
        return [lease for lease in self.leases.values() if isinstance(lease.task, GroupTask) and lease.task.group == task.group]

    def _grant(self, work: StepWork | None, task, worker: str, now: float, policy_version: int = 0) -> Lease:
        lease = Lease(self._next_lease, task, worker, now + self.lease_timeout_s, now, policy_version)
        self._next_lease += 1
        self.leases[lease.lease_id] = lease
        if work is not None and work.first_lease is None:
            work.first_lease = now
        return lease

    def _seen(self, worker: str, now: float, engine: EngineTime) -> WorkerState:
        state = self.workers.setdefault(worker, WorkerState(now))
        state.last_seen = now
        if engine.busy_seconds >= state.engine.busy_seconds:
            state.engine = engine
        return state

    def renew(self, worker: str, lease_ids: list[int], now: float, engine: EngineTime = EngineTime()) -> list[int]:
        """Extend the worker's leases; returns the ids it must abandon (expired, requeued or discarded)."""
        self._seen(worker, now, engine)
        lost = []
        for i in lease_ids:
            lease = self.leases.get(i)
            if lease is None or lease.worker != worker:
                lost.append(i)
            else:
                lease.expires = now + self.lease_timeout_s
        return lost

    def complete(self, worker: str, lease_id: int, result: GroupReport | ProbeResult | EvalRecord, now: float,
                 engine: EngineTime = EngineTime()) -> None:
        lease = self.leases.get(lease_id)
        if lease is None or lease.worker != worker:
            raise LeaseError(f"{worker}: lease {lease_id} is no longer held (expired, requeued or discarded)")
        del self.leases[lease_id]
        self._seen(worker, now, engine)
        if isinstance(lease.task, EvalTask):
            self.evals[lease.task.version].result = result
            return
        work = self._work_of(lease.task)
        if isinstance(lease.task, ProbeTask):
            work.probe_result = result
        else:
            work.done[lease.task.record.prompt_id] = (lease.task, result)
            work.leased_at[lease.task.record.prompt_id] = lease.policy_version
            for other in self._attempts_of(lease.task):  # a speculative twin: withdrawn, never trained
                del self.leases[other.lease_id]
                work.abandoned.append(other.task.request_id)
        work.last_done = now

    def holds(self, worker: str) -> list[Lease]:
        return [lease for lease in self.leases.values() if lease.worker == worker]
