"""3000 hypothesis-generated requests for every RPC against a trajectory server and a coordinator-like control
server (child processes), each judged by the oracle written from docs/grpc_api.md's rules: none is answered
otherwise (no invalid request accepted, no valid one refused, no UNKNOWN/INTERNAL), every finish reason and
every field's rule is exercised, and valid traffic is served afterwards. benchmarks/fuzz_grpc.py runs the
same with >= 100,000 requests. (Before issue 44's fixes such a run found failed samples with top_k out of
range accepted.)"""

from sparrow.bench.fuzz.cases import cases, fuzz_config
from sparrow.bench.fuzz.fuzzer import Fuzzer, FuzzTargets, valid_traffic
from sparrow.bench.fuzz.harness import ServerProcess
from sparrow.bench.fuzz.oracle import ERROR, LENGTH, STOP
from sparrow.coordinator.transport import JobCredentials
from sparrow.protos import sparrow_v1_pb2 as pb


def test_generated_requests_get_the_answers_the_rules_call_for_and_the_servers_keep_serving():
    config = fuzz_config()
    credentials = JobCredentials.create(config)
    with ServerProcess(config, credentials) as trajectory, ServerProcess(config, credentials, "control") as control:
        targets = FuzzTargets(trajectory.address, control.address, trajectory.resume)
        with Fuzzer(targets, credentials) as fuzzer:
            report = fuzzer.run(cases(config, 3000, random_seed=1))
        after = valid_traffic(targets, config, credentials, "after", samples=20)
        stats = {"trajectory": trajectory.stats(), "control": control.stats()}
        alive = (trajectory.alive, control.alive)
    outcomes = report.outcomes
    assert [(o.rpc, o.target, o.label, str(o.expected), str(o.got)) for o in report.mismatches] == []
    assert len(outcomes) == 3000 and alive == (True, True)
    assert {(o.rpc, o.target) for o in outcomes} == {
        ("StreamSamples", "trajectory"), ("Drain", "trajectory"), ("Health", "trajectory"), ("ResizePool", "trajectory"),
        ("Drain", "control"), ("Health", "control"), ("ResizePool", "control")}
    assert sum(o.expected.code not in ("OK", "ACCEPTED") for o in outcomes) > 1000
    samples = [o for o in outcomes if o.finish_reason is not None]
    accepted_reasons = {o.finish_reason for o in samples if not o.broken}
    refused_reasons = {o.finish_reason for o in samples if o.broken}
    assert accepted_reasons == {STOP, LENGTH, ERROR} and refused_reasons > {STOP, LENGTH, ERROR}
    assert {name.split("[")[0] for o in samples for name in o.broken} == set(pb.Sample.DESCRIPTOR.fields_by_name)
    assert after == {"samples accepted": (20, 20), "health, drain, resume": (3, 3), "pool resizes accepted": (3, 3)}
    # Only valid resizes reached the resizing server's handler, each once; only accepted samples were queued.
    assert stats["control"]["resizes"] == sum(o.rpc == "ResizePool" and o.got.code == "OK" for o in outcomes) + 3
    assert stats["trajectory"]["accepted"] == sum(o.queued for o in outcomes) + 20
