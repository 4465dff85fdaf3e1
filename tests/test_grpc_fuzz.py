"""A few hundred hypothesis-generated malformed messages for every RPC against real servers: every one
gets the answer its mutation calls for and valid traffic still flows afterwards.
benchmarks/fuzz_grpc.py runs the same with >= 10,000 messages against servers in child processes."""

from sparrow.bench.fuzz.cases import cases, fuzz_config
from sparrow.bench.fuzz.fuzzer import Fuzzer, FuzzTargets, valid_traffic
from sparrow.bench.fuzz.harness import PoolRecorder
from sparrow.coordinator.transport import ControlServer, JobCredentials, TrajectoryServer


def test_malformed_messages_are_answered_naming_the_field_and_the_servers_keep_serving():
    config = fuzz_config()
    credentials = JobCredentials.create(config)
    recorder = PoolRecorder()
    with TrajectoryServer(config, credentials) as trajectory, ControlServer(config, credentials, recorder) as control:
        targets = FuzzTargets(trajectory.address, trajectory.resume, control.address)
        with Fuzzer(targets, config, credentials) as fuzzer:
            report = fuzzer.run(cases(config, 300, random_seed=1, resume=trajectory.resume))
        after = valid_traffic(targets, config, credentials, "after", samples=20)
        queued = len(trajectory.get_batch(10_000, timeout=1))
    outcomes = report.outcomes
    assert len(outcomes) >= 300
    assert {o.rpc for o in outcomes} == {"StreamSamples", "Drain", "Health", "ResizePool"}
    assert sum(o.expected.code not in ("OK", "ACCEPTED") for o in outcomes) > 250
    assert report.mismatches == []
    assert after == {"samples accepted": (20, 20), "health, drain, resume": (3, 3), "pool resizes accepted": (3, 3)}
    # Only valid resizes that reached the resizing server called its handler, each exactly once.
    resized = [o for o in outcomes if o.rpc == "ResizePool" and o.got.code == "OK"]
    assert len(resized) >= 1 and len(recorder.resizes) == len(resized) + 3
    assert {pool for pool, _ in recorder.resizes} == {"rollout"} and all(1 <= n <= 1024 for _, n in recorder.resizes)
    accepted = sum(o.got.code == "ACCEPTED" for o in outcomes if o.rpc == "StreamSamples")
    assert queued == accepted + 20  # the valid fuzz samples and the 20 afterwards, nothing else
