"""The pull-based work queue's bookkeeping: leases, fair shares, admission by policy version, expiry,
lost workers, retirement, rollbacks and the exactly-once property under random faults."""

import random

import pytest

from sparrow.coordinator.data import PromptRecord
from sparrow.coordinator.step_record import GroupReport
from sparrow.coordinator.work_queue import GroupTask, LeaseError, ProbeResult, ProbeTask, WorkQueue


def records(step: int, n: int) -> list[PromptRecord]:
    return [PromptRecord(f"s{step}-p{i}", ({"role": "user", "content": str(i)},), str(i), step * n + i) for i in range(n)]


def report(worker: str, task: GroupTask, samples: int = 2) -> GroupReport:
    ids = [f"{task.request_id}#{j}" for j in range(samples)]
    return GroupReport(worker, samples, 0, 10, samples, 0, [], 1, ids, 1.0)


def test_a_worker_leases_its_fair_share_and_completes_groups():
    q = WorkQueue(max_staleness=0, lease_timeout_s=10)
    q.add_step(0, records(0, 6))
    q.lease("w1", 0, 8, now=0.0)  # w1 registers first: with no one else seen it may take everything
    q2 = WorkQueue(max_staleness=0, lease_timeout_s=10)
    q2.add_step(0, records(0, 6))
    q2.renew("w2", [], now=0.0)
    q2.renew("w3", [], now=0.0)
    first = q2.lease("w1", 0, 8, now=0.0)
    assert len(first) == 2, "6 groups over 3 active workers: a share of 2"
    assert q2.lease("w1", 0, 8, now=0.0) == [], "asking again right away gives nothing more"
    assert [lease.task.request_id for lease in first] == ["s0-p0", "s0-p1"], "oldest first, attempt 0 keeps the prompt id"
    for lease in first:
        q2.complete("w1", lease.lease_id, report("w1", lease.task), now=1.0)
    assert len(q2.steps[0].done) == 2 and not q2.step_complete(0)
    assert len(q2.lease("w1", 0, 8, now=1.0)) == 2, "done early: a fair share of the 4 left"


def test_admission_bounds_staleness():
    q = WorkQueue(max_staleness=1, lease_timeout_s=10)
    q.add_step(3, records(3, 2))
    assert q.lease("w", 1, 4, now=0.0) == [], "version 1 is two versions behind step 3"
    assert q.lease("w", 4, 4, now=0.0) == [], "a worker ahead of the step (a rolled-back trainer) must resync first"
    assert len(q.lease("w", 2, 4, now=0.0)) == 2


def test_expired_and_lost_leases_are_retried_as_new_attempts_and_late_completions_refused():
    q = WorkQueue(max_staleness=0, lease_timeout_s=10)
    q.add_step(0, records(0, 2))
    a, b = q.lease("slow", 0, 2, now=0.0)
    assert q.renew("slow", [a.lease_id, b.lease_id], now=5.0) == []
    assert [lease.lease_id for lease in q.expire(now=14.0)] == [], "renewed at t=5: valid until t=15"
    assert len(q.expire(now=15.0)) == 2
    retry = q.lease("fast", 0, 2, now=15.0)
    assert [lease.task.request_id for lease in retry] == ["s0-p0.r1", "s0-p1.r1"]
    with pytest.raises(LeaseError):
        q.complete("slow", a.lease_id, report("slow", a.task), now=16.0)
    assert q.renew("slow", [a.lease_id], now=16.0) == [a.lease_id], "the slow worker learns it lost the lease"
    lost = q.release("fast")
    assert len(lost) == 2
    again = q.lease("third", 0, 2, now=17.0)
    assert len(again) == 1, "'slow' still renews, so two workers share the two groups"
    assert q.lease("third", 0, 2, now=17.0) == [], "'third' already holds its share"
    again += q.lease("slow", 0, 2, now=17.0)
    assert [lease.task.attempt for lease in again] == [2, 2]
    assert q.steps[0].requeued == 4


def test_probe_goes_to_an_idle_worker_and_the_step_waits_for_it():
    q = WorkQueue(max_staleness=0, lease_timeout_s=10)
    q.add_step(0, records(0, 2), probe=records(0, 1))
    busy = q.lease("w1", 0, 1, now=0.0)
    assert isinstance(busy[0].task, ProbeTask), "an idle worker takes the probe first"
    groups = q.lease("w1", 0, 2, now=0.0)
    assert all(isinstance(lease.task, GroupTask) for lease in groups), "a busy worker is never given a probe"
    for lease in groups:
        q.complete("w1", lease.lease_id, report("w1", lease.task), now=1.0)
    assert not q.step_complete(0)
    q.complete("w1", busy[0].lease_id, ProbeResult(30.0, 20.0), now=2.0)
    assert q.step_complete(0) and q.take_step(0).probe_result.speedup == 1.5


def test_retired_workers_lease_nothing_and_rollbacks_never_reuse_request_ids():
    q = WorkQueue(max_staleness=1, lease_timeout_s=10)
    q.add_step(0, records(0, 2))
    q.add_step(1, records(1, 2))
    held = q.lease("w", 0, 4, now=0.0)
    q.retire("w")
    assert q.lease("w", 0, 4, now=0.0) == []
    assert len(q.discard_from(0)) == len(held)
    assert not q.steps and not q.leases
    q.add_step(0, records(0, 2))
    redo = q.lease("v", 0, 4, now=1.0)
    assert {lease.task.request_id for lease in redo} == {"s0-p0.r1", "s0-p1.r1"}


def test_an_idle_worker_backs_up_a_slow_workers_groups_and_the_first_attempt_to_finish_wins():
    """Speculation: once nothing is pending, an idle worker gets new attempts of groups held longer than
    speculate_after_s (once a group); the first completion is the group's, the twin's lease is withdrawn."""
    q = WorkQueue(max_staleness=0, lease_timeout_s=10, speculate_after_s=2.0)
    off = WorkQueue(max_staleness=0, lease_timeout_s=10)
    for queue in (q, off):
        queue.add_step(0, records(0, 4))
        queue.renew("slow", [], now=0.0)
        queue.renew("fast", [], now=0.0)
    a, b = q.lease("slow", 0, 4, now=0.0)
    for lease in q.lease("fast", 0, 4, now=0.0):
        q.complete("fast", lease.lease_id, report("fast", lease.task), now=1.0)
    assert q.lease("fast", 0, 4, now=1.5) == [], "held 1.5 s: not yet a straggler"
    backups = q.lease("fast", 0, 4, now=2.5)
    assert [lease.task.request_id for lease in backups] == ["s0-p0.r1", "s0-p1.r1"]
    assert q.steps[0].speculated == 2 and q.lease("other", 0, 4, now=3.0) == [], "one backup a group"
    q.complete("fast", backups[0].lease_id, report("fast", backups[0].task), now=3.0)
    assert q.renew("slow", [a.lease_id, b.lease_id], now=3.0) == [a.lease_id], "the slow twin is withdrawn"
    with pytest.raises(LeaseError):
        q.complete("slow", a.lease_id, report("slow", a.task), now=3.2)
    q.complete("slow", b.lease_id, report("slow", b.task), now=3.5)
    with pytest.raises(LeaseError):
        q.complete("fast", backups[1].lease_id, report("fast", backups[1].task), now=3.6)
    work = q.take_step(0)
    assert {p: task.request_id for p, (task, _) in work.done.items() if p in ("s0-p0", "s0-p1")} == {
        "s0-p0": "s0-p0.r1", "s0-p1": "s0-p1"}
    assert work.requeued == 0 and not q.leases
    off.lease("slow", 0, 4, now=0.0)
    for lease in off.lease("fast", 0, 4, now=0.0):
        off.complete("fast", lease.lease_id, report("fast", lease.task), now=1.0)
    assert off.lease("fast", 0, 4, now=60.0) == [] and off.steps[0].speculated == 0, "speculation is opt-in"


def test_a_lost_attempt_with_a_running_twin_is_not_generated_a_third_time():
    q = WorkQueue(max_staleness=0, lease_timeout_s=10, speculate_after_s=1.0)
    q.add_step(0, records(0, 1))
    (original,) = q.lease("slow", 0, 4, now=0.0)
    (backup,) = q.lease("fast", 0, 4, now=1.0)
    assert len(q.expire(now=10.0)) == 1, "the slow worker stopped renewing"
    assert not q.steps[0].pending and q.steps[0].requeued == 0, "the backup still runs: nothing is requeued"
    q.renew("fast", [backup.lease_id], now=10.0)
    q.complete("fast", backup.lease_id, report("fast", backup.task), now=11.0)
    assert q.step_complete(0) and q.steps[0].done["s0-p0"][0].attempt == 1
    q2 = WorkQueue(max_staleness=0, lease_timeout_s=10, speculate_after_s=1.0)
    q2.add_step(0, records(0, 1))
    q2.lease("slow", 0, 4, now=0.0)
    q2.lease("fast", 0, 4, now=1.0)
    q2.release("fast")
    assert not q2.steps[0].pending and q2.steps[0].requeued == 0, "a lost backup leaves the original running"
    assert original.task.attempt == 0 and backup.task.attempt == 1


def _complete_any(q: WorkQueue, worker: str, held: list, rng: random.Random, now: float) -> None:
    """The worker completes one of its leases, picked at random; one it no longer holds is refused, as it must."""
    lease = held.pop(rng.randrange(len(held)))
    try:
        q.complete(worker, lease.lease_id, report(worker, lease.task), now)
    except LeaseError:
        pass


@pytest.mark.parametrize("speculate_after_s", [None, 2.0], ids=["plain", "speculation"])
def test_every_group_completes_exactly_once_under_random_faults(speculate_after_s):
    """Random leases, completions, expiries, lost workers and late completions (and, with speculation, twin
    attempts): each group of each step ends up completed once, by one attempt, and the step's samples carry
    that attempt's ids."""
    rng = random.Random(7)
    q = WorkQueue(max_staleness=1, lease_timeout_s=3, speculate_after_s=speculate_after_s)
    steps, groups = 6, 5
    for s in range(2):
        q.add_step(s, records(s, groups))
    version, now, finished = 0, 0.0, {}
    workers = [f"w{i}" for i in range(4)]
    held: dict[str, list] = {w: [] for w in workers}
    late = []
    while version < steps:
        now += 1.0
        q.expire(now)
        w = rng.choice(workers)
        roll = rng.random()
        if roll < 0.1:
            q.release(w)
            late += held[w]
            held[w] = []
        elif roll < 0.5:
            held[w] += q.lease(w, version if rng.random() < 0.8 else max(version - 1, 0), rng.randint(1, 3), now)
        elif held[w]:
            _complete_any(q, w, held[w], rng, now)
        if late and rng.random() < 0.3:
            lease = late.pop()
            with pytest.raises(LeaseError):
                q.complete(lease.worker, lease.lease_id, report(lease.worker, lease.task), now)
        if version in q.steps and q.step_complete(version):
            work = q.take_step(version)
            finished[version] = work
            version += 1
            if version + 1 < steps:
                q.add_step(version + 1, records(version + 1, groups))
    assert sorted(finished) == list(range(steps))
    for s, work in finished.items():
        assert sorted(work.done) == [f"s{s}-p{i}" for i in range(groups)]
        for prompt, (task, rep) in work.done.items():
            assert rep.sample_ids == [f"{task.request_id}#{j}" for j in range(2)]
    all_ids = [i for w in finished.values() for _, rep in w.done.values() for i in rep.sample_ids]
    assert len(all_ids) == len(set(all_ids)) == steps * groups * 2
    assert (sum(w.speculated for w in finished.values()) > 0) == (speculate_after_s is not None)


def test_partial_rollouts_train_the_first_groups_done_and_carry_the_rest_with_their_leases():
    q = WorkQueue(max_staleness=0, lease_timeout_s=10, carry_staleness=2)
    q.add_step(0, records(0, 3) + records(90, 2), needed=3)  # 2 spare groups
    leases = q.lease("w", 0, 8, now=0.0)
    assert len(leases) == 5 and all(lease.policy_version == 0 for lease in leases)
    for lease in [leases[4], leases[1], leases[0], leases[2]]:  # completion order: s90-p1, s0-p1, s0-p0, s0-p2
        q.complete("w", lease.lease_id, report("w", lease.task), now=1.0)
    assert q.step_complete(0)
    work = q.take_step(0)
    assert list(work.done) == ["s90-p1", "s0-p1", "s0-p0"], "the first 3 done are trained"
    assert sorted(work.carried_requests) == ["s0-p2", "s90-p0"], "one done, one still generating: both carry over"
    assert work.carried_out == 2
    q.add_step(1, records(1, 3), needed=3)
    nxt = q.steps[1]
    assert nxt.carried_in == 2 and list(nxt.done) == ["s0-p2"] and len(nxt.pending) == 3
    assert q.renew("w", [leases[3].lease_id], now=2.0) == [], "the carried lease is still held: it keeps generating"
    q.complete("w", leases[3].lease_id, report("w", leases[3].task), now=3.0)
    assert list(nxt.done) == ["s0-p2", "s90-p0"], "a carried group completes into the step it now counts toward"
    for lease in q.lease("w", 1, 8, now=3.0)[:1]:
        q.complete("w", lease.lease_id, report("w", lease.task), now=4.0)
    work = q.take_step(1)
    assert list(work.done) == ["s0-p2", "s90-p0", "s1-p0"] and sorted(work.carried_requests) == ["s1-p1", "s1-p2"]
    assert work.carried_out == 2 and len(q.steps[2].pending) == 0, "groups leased at step 1 carry as leases"


def test_a_group_that_would_pass_the_staleness_bound_holds_its_step_open():
    q = WorkQueue(max_staleness=0, lease_timeout_s=10, carry_staleness=1)
    q.add_step(0, records(0, 2), needed=1)
    slow, fast = q.lease("w", 0, 8, now=0.0)
    q.complete("w", fast.lease_id, report("w", fast.task), now=1.0)
    assert q.step_complete(0), "step 0 closes: the slow group, leased at version 0, may still train at step 1"
    q.take_step(0)
    q.add_step(1, records(1, 2), needed=1)
    first = q.lease("w", 1, 8, now=2.0)
    q.complete("w", first[0].lease_id, report("w", first[0].task), now=3.0)
    assert len(q.steps[1].done) == 1 and not q.step_complete(1), "trained at step 2 it would be 2 versions old"
    assert [lease.lease_id for lease in q.held_open(1)] == [slow.lease_id]
    with pytest.raises(ValueError, match="1 held open"):
        q.take_step(1)
    q.complete("w", slow.lease_id, report("w", slow.task), now=4.0)
    assert q.step_complete(1) and "s0-p0" in q.take_step(1).done


def test_a_time_budget_closes_a_step_with_the_groups_done_within_the_carry_limit():
    """needed 4, 1 spare: over budget the step may close with fewer done (never none), training what is done,
    as long as it leaves at most `budget_carry` groups; each group is trained exactly once across the steps."""
    q = WorkQueue(max_staleness=0, lease_timeout_s=10, carry_staleness=2)
    q.add_step(0, records(0, 4) + records(90, 1), needed=4)
    leases = q.lease("w", 0, 8, now=0.0)
    assert not q.step_complete(0, budget_carry=5), "nothing done: a budget close never trains an empty step"
    q.complete("w", leases[2].lease_id, report("w", leases[2].task), now=1.0)
    assert not q.step_complete(0), "without the budget the step waits for its 4 groups"
    assert not q.step_complete(0, budget_carry=3), "closing now would carry 4 groups, more than the limit of 3"
    assert q.step_complete(0, budget_carry=4)
    work = q.take_step(0, budget_carry=4)
    assert work.closed_by_budget and list(work.done) == ["s0-p2"] and work.carried_out == 4
    assert sorted(work.carried_requests) == ["s0-p0", "s0-p1", "s0-p3", "s90-p0"]
    q.add_step(1, records(1, 4), needed=4)
    assert q.steps[1].carried_in == 4 and len(q.steps[1].pending) == 4
    for lease in leases[:2] + leases[3:]:
        q.complete("w", lease.lease_id, report("w", lease.task), now=2.0)
    assert q.step_complete(1), "the 4 carried groups done: a full step"
    nxt = q.take_step(1)
    assert not nxt.closed_by_budget and sorted(nxt.done) == ["s0-p0", "s0-p1", "s0-p3", "s90-p0"]
    assert nxt.carried_out == 4 and len(q.steps[2].pending) == 4, "step 1's own groups, not started, carry on"
    trained = list(work.done) + list(nxt.done)
    assert len(trained) == len(set(trained)) == 5


def test_budget_closes_under_random_faults_lose_and_duplicate_nothing():
    """Partial rollouts with a time budget that runs out at random, workers lost and leases expiring: every group
    queued is trained once or is still in the queue at the end (0 lost, 0 duplicated), no step closes empty, and the
    groups carried never pass the limit."""
    rng = random.Random(11)
    limit, needed = 6, 4
    q = WorkQueue(max_staleness=0, lease_timeout_s=3, carry_staleness=3)
    q.add_step(0, records(0, needed) + records(90, 2), needed=needed)
    added = {f"s0-p{i}" for i in range(needed)} | {"s90-p0", "s90-p1"}
    version, now, trained, closes = 0, 0.0, [], 0
    workers = ["w0", "w1", "w2"]
    held: dict[str, list] = {w: [] for w in workers}
    while version < 12:
        now += 1.0
        q.expire(now)
        w, roll = rng.choice(workers), rng.random()
        if roll < 0.05:
            q.release(w)
            held[w] = []
        elif roll < 0.4:
            held[w] += q.lease(w, version, rng.randint(1, 3), now)
        elif held[w]:
            _complete_any(q, w, held[w], rng, now)
        budget = limit if rng.random() < 0.3 else None
        if q.step_complete(version, budget):
            work = q.take_step(version, budget)
            assert work.done and (not work.closed_by_budget or work.carried_out <= limit)
            closes += work.closed_by_budget
            trained += [task.record.prompt_id for task, _ in work.done.values()]
            version += 1
            q.add_step(version, records(version, needed), needed=needed)
            added |= {f"s{version}-p{i}" for i in range(needed)}
    left = {p for w in q.steps.values() for p in [*w.pending, *w.done]}
    left |= {lease.task.record.prompt_id for lease in q.leases.values()}
    assert len(trained) == len(set(trained)), "no group trained twice"
    assert set(trained) | left == added and not set(trained) & left, "every group trained or still queued"
    assert closes > 0


def test_a_time_budget_waits_for_groups_held_open_and_needs_partial_rollouts():
    q = WorkQueue(max_staleness=0, lease_timeout_s=10, carry_staleness=1)
    q.add_step(0, records(0, 2), needed=2)
    slow, fast = q.lease("w", 0, 8, now=0.0)
    q.complete("w", fast.lease_id, report("w", fast.task), now=1.0)
    q.take_step(0, budget_carry=2)
    q.add_step(1, records(1, 2), needed=2)
    for lease in q.lease("w", 1, 8, now=2.0):
        q.complete("w", lease.lease_id, report("w", lease.task), now=3.0)
    assert q.held_open(1) and not q.step_complete(1, budget_carry=10), "the carried group may not carry again"
    q.complete("w", slow.lease_id, report("w", slow.task), now=4.0)
    assert q.step_complete(1, budget_carry=0)
    plain = WorkQueue(max_staleness=0, lease_timeout_s=10)
    plain.add_step(0, records(0, 2))
    lease = plain.lease("w", 0, 8, now=0.0)[0]
    plain.complete("w", lease.lease_id, report("w", lease.task), now=1.0)
    with pytest.raises(ValueError, match="time budget close needs partial rollouts"):
        plain.step_complete(0, budget_carry=2)


def test_a_carried_group_whose_worker_is_lost_is_requeued_whole_and_a_rollback_drops_carried_groups():
    q = WorkQueue(max_staleness=0, lease_timeout_s=10, carry_staleness=2)
    q.add_step(0, records(0, 2), needed=1)
    a, b = q.lease("w1", 0, 8, now=0.0)
    q.complete("w1", a.lease_id, report("w1", a.task), now=1.0)
    q.take_step(0)
    assert q.release("w1") == [b], "the carried lease is the lost worker's"
    q.add_step(1, records(1, 1), needed=1)
    retry = q.lease("w2", 1, 8, now=2.0)
    assert sorted(lease.task.request_id for lease in retry) == ["s0-p1.r1", "s1-p0"], "a new attempt, leased fresh"
    assert q.steps[1].abandoned == ["s0-p1"], "the lost attempt's samples are never trained"
    assert len(q.discard_from(1)) == 2 and q.home == {} and 1 not in q.steps
    with pytest.raises(ValueError, match="needs partial rollouts"):
        WorkQueue(max_staleness=0, lease_timeout_s=10).add_step(0, records(0, 2), needed=1)
    with pytest.raises(ValueError, match="carry_staleness=1 must exceed max_staleness=1"):
        WorkQueue(max_staleness=1, lease_timeout_s=10, carry_staleness=1)


def test_the_queue_keeps_each_workers_latest_engine_time_whatever_order_reports_arrive_in():
    from sparrow.coordinator.metrics import EngineTime

    q = WorkQueue(max_staleness=0, lease_timeout_s=10)
    q.add_step(0, records(0, 2))
    (lease, *_) = q.lease("w", 0, 1, now=0.0, engine=EngineTime(2.0, (0.0, 2.0)))
    q.renew("w", [lease.lease_id], now=1.0, engine=EngineTime(5.0, (0.0, 4.0, 1.0)))
    q.complete("w", lease.lease_id, report("w", lease.task), now=1.5, engine=EngineTime(4.0, (0.0, 4.0)))  # older
    assert q.workers["w"].engine == EngineTime(5.0, (0.0, 4.0, 1.0)), "a late-arriving older report is ignored"
    q.release("w")
    q.lease("w", 0, 1, now=2.0, engine=EngineTime(0.5, (0.0, 0.5)))
    assert q.workers["w"].engine.busy_seconds == 0.5, "a replacement under the same name counts from 0"
