"""Sending fuzz cases (`cases.py`) to real servers and judging every answer.

Used by benchmarks/fuzz_grpc.py (>= 10,000 messages) and tests/test_grpc_fuzz.py (a small sample).
"""

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from sparrow.protos import sparrow_v1_pb2 as pb

from sparrow.coordinator.transport.client import ControlClient, TrajectoryClient
from sparrow.coordinator.transport.config import TransportConfig
from sparrow.coordinator.transport.security import JobCredentials

from .cases import STREAMS, Answer, Call, Payload
from .examples import valid_sample

BATCH = 16
"""Stream payloads sent on one stream (below the granted window, so all are in flight at once)."""
SERVICES = {m.name: s.full_name for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods}
"""Full service name of each RPC."""


@dataclass
class Outcome:
    rpc: str
    label: str
    expected: Answer
    got: Answer

    @property
    def matched(self) -> bool:
        e, g = self.expected, self.got
        if e.kind == "ack" and e.code == "ACCEPTED":
            return g.kind == "ack" and g.code in ("ACCEPTED", "DUPLICATE")
        return (e.kind, e.code) == (g.kind, g.code) and (e.field is None or e.field == g.field)


@dataclass
class FuzzTargets:
    """Where each RPC goes: the trajectory server serves StreamSamples, Drain and Health, `control` (a
    ControlServer whose handler resizes, like the coordinator's) ResizePool."""

    trajectory: str
    resume: Callable[[], None]
    control: str | None = None


@dataclass
class FuzzReport:
    outcomes: list[Outcome] = field(default_factory=list)

    def by_rpc(self) -> dict[str, Counter]:
        table: dict[str, Counter] = {}
        for o in self.outcomes:
            c = table.setdefault(o.rpc, Counter())
            c["messages"] += 1
            c["invalid"] += o.expected.code not in ("OK", "ACCEPTED")
            c["as expected"] += o.matched
        return table

    def by_label(self) -> dict[tuple[str, str], Counter]:
        table: dict[tuple[str, str], Counter] = {}
        for o in self.outcomes:
            c = table.setdefault((o.rpc, o.label), Counter())
            c["messages"] += 1
            c["as expected"] += o.matched
            c[f"expected {o.expected.kind} {o.expected.code}"] += 1
        return table

    @property
    def mismatches(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.matched]


def _ack_answer(ack: pb.Ack) -> Answer:
    return Answer("ack", pb.AckStatus.Name(ack.status).removeprefix("ACK_STATUS_"), ack.field or None)


def _status_answer(error: grpc.RpcError) -> Answer:
    details = error.details() or ""
    return Answer("status", error.code().name, details.split(":")[0] if ":" in details else None)


class Fuzzer:
    """Sends cases over raw channels (requests as bytes) that carry the job's token, and records answers."""

    def __init__(self, targets: FuzzTargets, config: TransportConfig, credentials: JobCredentials):
        self.targets, self.config = targets, config
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", 64 * 2**20)]
        self._channels = {"trajectory": credentials.channel(targets.trajectory, options)}
        if targets.control is not None:
            self._channels["control"] = credentials.channel(targets.control, options)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def __enter__(self) -> "Fuzzer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _method(self, rpc: str, target: str | None = None):
        target = target or {"ResizePool": "control"}.get(rpc, "trajectory")
        if target not in self._channels:
            raise ValueError(f"{rpc} cases need FuzzTargets.{target} (a ControlServer whose handler resizes pools)")
        channel = self._channels[target]
        path = f"/{SERVICES[rpc]}/{rpc}"
        if rpc in STREAMS:
            return channel.stream_stream(path, request_serializer=None, response_deserializer=pb.StreamReply.FromString)
        return channel.unary_unary(path, request_serializer=None, response_deserializer=None)

    def run(self, cases: list) -> FuzzReport:
        """Calls one by one, then the payloads of each stream RPC in batches of `BATCH` per stream."""
        report = FuzzReport()
        payloads: dict[str, list[Payload]] = {}
        for case in cases:
            if isinstance(case, Payload):
                payloads.setdefault(case.rpc, []).append(case)
            else:
                report.outcomes.append(self._call(case))
        for rpc, items in payloads.items():
            for i in range(0, len(items), BATCH):
                report.outcomes += self._stream(rpc, items[i:i + BATCH])
        return report

    def _stream(self, rpc: str, items: list[Payload]) -> list[Outcome]:
        request_type, payload = STREAMS[rpc]
        requests = [request_type(open=pb.StreamOpen(client_id="fuzz")).SerializeToString()]
        requests += [request_type(**{payload: p.message}).SerializeToString() for p in items]
        answers: list[Answer] = []
        try:
            answers = [_ack_answer(r.ack) for r in self._method(rpc)(iter(requests), timeout=60) if r.WhichOneof("kind") == "ack"]
        except grpc.RpcError as exc:
            answers += [_status_answer(exc)] * (len(items) - len(answers))
        answers += [Answer("status", "OK", "stream ended without an ack")] * (len(items) - len(answers))
        return [Outcome(rpc, p.label, p.expected, got) for p, got in zip(items, answers)]

    def _call(self, case: Call) -> Outcome:
        requests = case.requests()
        try:
            if case.rpc in STREAMS:
                acks = [r.ack for r in self._method(case.rpc)(iter(requests), timeout=60) if r.WhichOneof("kind") == "ack"]
                got = _ack_answer(acks[-1]) if acks else Answer("status", "OK")
            else:
                self._method(case.rpc, case.target)(requests[0], timeout=60)
                got = Answer("status", "OK")
        except grpc.RpcError as exc:
            got = _status_answer(exc)
        if case.after is not None and got.code == "OK":
            case.after()
        return Outcome(case.rpc, case.label, case.expected, got)


def valid_traffic(targets: FuzzTargets, config: TransportConfig, credentials: JobCredentials, prefix: str,
                  samples: int = 200) -> dict[str, tuple[int, int]]:
    """Valid samples and control calls; (accepted or served, sent) per kind."""
    with TrajectoryClient(targets.trajectory, config, credentials) as client:
        accepted = client.send(valid_sample(i, prefix, vocab=config.vocab_size) for i in range(samples)).accepted
    with ControlClient(targets.trajectory, config, credentials) as control:
        states = [control.health().status]
        control.drain(0.0)
        states.append(control.health().status)
        targets.resume()
        states.append(control.health().status)
    served = sum(a == b for a, b in zip(states, ("serving", "draining", "serving")))
    out = {"samples accepted": (accepted, samples), "health, drain, resume": (served, 3)}
    if targets.control is not None:
        with ControlClient(targets.control, config, credentials) as control:
            resized = [control.resize_pool("rollout", n)[:2] == (True, n) for n in (2, 5, 1)]
        out["pool resizes accepted"] = (sum(resized), len(resized))
    return out
