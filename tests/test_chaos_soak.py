"""The chaos soak (benchmarks/chaos_soak.py, issue 44 item 10): its audit rules on their own numbers — exactly-once
from a ledger, the continuity of metric series, when a fault counts as resolved — how it finds a worker's process,
its refusals, and (slow) a short soak of a real `sparrow train` job with two faults: 0 lost, 0 duplicated, every
fault resolved, every coordinator series continuous, a clean stop."""

import json
import os
import socket

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from sparrow.bench.chaos_audit import (Fault, audit_ledger, check_continuity, logical_id, parse_metrics,
                                       resolving_event, resolving_step)
from sparrow.bench.chaos_soak import main
from sparrow.bench.chaos_watch import listening_pid


def _line(step: int, trained: list[str], abandoned=(), dropped=()) -> dict:
    return {"step": step, "policy_version": step, "schedule_versions": [0], "trained_ids": [trained],
            "abandoned_attempts": list(abandoned), "dropped_samples": list(dropped)}


EXPECTED = [f"s{k}-p{p}#{i}" for k in range(2) for p in range(2) for i in range(2)]


def test_a_retried_attempt_counts_as_the_sample_it_replaces():
    assert logical_id("s3-p1.r2#0") == "s3-p1#0" and logical_id("s3-p1#0") == "s3-p1#0"
    ledger = [_line(0, ["s0-p0#0", "s0-p0#1", "s0-p1.r1#0", "s0-p1.r1#1"], abandoned=["s0-p1"], dropped=["s0-p1#0"]),
              _line(1, ["s1-p1#1", "s1-p0#0", "s1-p0#1", "s1-p1#0"])]
    audit = audit_ledger(ledger, EXPECTED)
    assert (audit.steps, audit.dispatched, audit.trained, audit.abandoned_attempts, audit.dropped_samples) == (2, 8, 8, 1, 1)
    assert audit.exactly_once


def test_lost_duplicated_unexpected_and_misordered_samples_are_named():
    ledger = [_line(0, ["s0-p0#0", "s0-p0#1", "s0-p1#0", "s0-p1.r1#0", "s0-p1#1"]),
              _line(1, ["s1-p0#0", "s1-p0#1", "s1-p1#0", "s9-p0#0"])]
    audit = audit_ledger(ledger, EXPECTED)
    assert (audit.lost, audit.duplicated, audit.unexpected) == (["s1-p1#1"], ["s0-p1#0"], ["s9-p0#0"])
    assert not audit.exactly_once
    assert audit_ledger([ledger[1], ledger[0]], EXPECTED).misordered, "steps 1, 0"


def _scrape(train_step: float, recoveries: float = 0.0, extra: bool = True) -> dict:
    series = {("sparrow_train_step", ()): train_step, ("sparrow_recoveries_total", (("kind", "trainer_lost"),)): recoveries}
    if extra:
        series[("sparrow_rollout_utilisation", (("worker", "rollout-0"),))] = 0.5
    return series


def test_continuous_series_and_a_redo_after_a_trainer_recovery():
    scrapes = [(0.0, _scrape(3)), (2.0, _scrape(5)), (4.0, _scrape(4, recoveries=1)), (6.0, _scrape(6, recoveries=1))]
    result = check_continuity(scrapes, [{"kind": "trainer_lost"}], checkpoint_every=2)
    assert result.continuous and result.step_drops == ["5 -> 4 at 4 s"] and (result.scrapes, result.series) == (4, 3)
    assert check_continuity(scrapes, [], checkpoint_every=2).unexplained_drops == ["5 -> 4 at 4 s"], "no recovery"
    too_far = check_continuity(scrapes[:1] + [(2.0, _scrape(7)), (4.0, _scrape(4))], [{"kind": "trainer_lost"}], 2)
    assert too_far.unexplained_drops == ["7 -> 4 at 4 s"], "a rollback redoes at most checkpoint_every steps"


def test_a_lost_series_a_falling_counter_and_an_unanswered_scrape_break_continuity():
    result = check_continuity([(0.0, _scrape(1, recoveries=2)), (2.0, None), (4.0, _scrape(2, recoveries=1, extra=False))],
                              [], checkpoint_every=1)
    assert result.unanswered == 1 and not result.continuous
    assert result.disappeared == ['sparrow_rollout_utilisation{worker="rollout-0"} at 4 s']
    assert result.decreased == ['sparrow_recoveries_total{kind="trainer_lost"} 2 -> 1 at 4 s']


def test_metrics_text_is_parsed_without_created_timestamps():
    registry = CollectorRegistry()
    Counter("sparrow_recoveries", "recoveries", ["kind"], registry=registry).labels(kind="trainer_lost").inc(3)
    Gauge("sparrow_train_step", "steps", registry=registry).set(7)
    assert parse_metrics(generate_latest(registry).decode()) == {
        ("sparrow_recoveries_total", (("kind", "trainer_lost"),)): 3.0, ("sparrow_train_step", ()): 7.0}


def test_when_a_fault_counts_as_resolved():
    kill = Fault("kill-rollout", "rollout-1", 4242, at=100.0, step=40)
    events = [(90.0, {"kind": "rollout_worker_lost", "subject": "rollout-1", "recovery_seconds": 5.0}),
              (120.0, {"kind": "rollout_worker_lost", "subject": "rollout-0", "recovery_seconds": 6.0}),
              (130.0, {"kind": "rollout_worker_lost", "subject": "rollout-1", "recovery_seconds": None}),
              (140.0, {"kind": "rollout_worker_lost", "subject": "rollout-1", "recovery_seconds": 7.5})]
    assert resolving_event(kill, events)[0] == 140.0, "after the fault, its worker, recovered"
    assert resolving_event(Fault("kill-trainer", "trainer-0", 1, at=100.0, step=40), events) is None
    records = [(110.0, {"rollout": {"groups": {"rollout-0": 8}}}), (125.0, {"rollout": {"groups": {"rollout-0": 4}}}),
               (127.0, {"rollout": {"groups": {"rollout-0": 4, "rollout-1": 4}}})]
    stall = Fault("stall-rollout", "rollout-1", 4242, at=100.0, step=40, stall_s=30.0)
    assert resolving_step(stall, records, resumed_at=120.0)[0] == 127.0, "a step with the stalled worker's groups"
    assert resolving_step(Fault("stall-trainer", "trainer-0", 1, 100.0, 40, 30.0), records, 120.0)[0] == 125.0


def test_a_worker_process_is_found_by_its_listening_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert listening_pid(port) == os.getpid()
    assert listening_pid(port) is None


@pytest.mark.parametrize("argv,message", [
    (["--faults", "kill-rollout,explode"], "explode unknown"),
    (["--interval", "30", "10"], "need 0 < MIN_S <= MAX_S"),
    (["--stall-s", "5", "--lease-timeout-s", "8"], "a stall must outlast the lease"),
])
def test_refusals(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
def test_a_short_soak_loses_and_duplicates_nothing(tiny_qwen3, tmp_path):
    """One rollout worker kill 10-15 s into a 30 s window, end to end through the audit (the stalls and the
    trainer's faults are in the recorded 30-minute soak and in tests/test_reliability.py)."""
    out = tmp_path / "soak"
    code = main(["--minutes", "0.5", "--seed", "1", "--interval", "10", "15", "--faults", "kill-rollout",
                 "--lease-timeout-s", "8", "--hung-worker-timeout-s", "5", "--stall-s", "15", "--settle-s", "120",
                 "--grace-s", "120", "--model", str(tiny_qwen3), "--run-root", str(tmp_path / "runs"), "--out", str(out)])
    result = json.loads((out / "soak.json").read_text())
    assert [f["kind"] for f in result["faults"]][:1] == ["kill-rollout"], result["faults"]
    assert all(f["recovered_after"] is not None for f in result["faults"]), result["faults"]
    ledger = result["ledger"]
    assert (ledger["lost_count"], ledger["duplicated_count"], ledger["unexpected_count"], ledger["misordered"]) == \
        (0, 0, 0, False), ledger
    assert ledger["trained"] == ledger["dispatched"] > 0 and result["steps"] > 0
    assert result["continuity"]["continuous"], result["continuity"]
    assert result["clean_stop"] and result["job_exit_code"] == 130
    assert code == 0 and result["ok"]
