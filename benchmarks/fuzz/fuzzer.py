"""Sending generated requests (`cases.py`) to real servers and judging every answer against the oracle.

Used by benchmarks/fuzz_grpc.py (>= 100,000 requests) and tests/test_grpc_fuzz.py (a few thousand).
"""

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from sparrow.coordinator.transport.client import ControlClient, TrajectoryClient
from sparrow.coordinator.transport.config import TransportConfig
from sparrow.coordinator.transport.security import JobCredentials
from sparrow.protos import sparrow_v1_pb2 as pb

from .cases import Call, Payload
from .examples import valid_sample
from .oracle import ACCEPTED, OK, Expected

BATCH = 16
"""Samples sent on one stream (below the granted window, so all are in flight at once)."""
SERVICES = {m.name: s.full_name for s in pb.DESCRIPTOR.services_by_name.values() for m in s.methods}
"""Full service name of each RPC."""
HANDLER_FAILURES = ("UNKNOWN", "INTERNAL")
"""Statuses no request may cause: a handler raised."""


@dataclass(frozen=True)
class Got:
    """What a request got: an ack (`kind="ack"`) or the call's status, and the field the answer named."""

    kind: str
    code: str
    field: str | None = None

    def __str__(self) -> str:
        return f"{self.kind} {self.code}" + (f" {self.field}" if self.field else "")


@dataclass
class Outcome:
    rpc: str
    target: str
    label: str
    expected: Expected
    got: Got
    broken: frozenset[str] = frozenset()
    finish_reason: int | None = None
    queued: int = 0
    """Samples the request's acks said were queued (ACCEPTED); a call may queue one and then end otherwise."""

    @property
    def verdict(self) -> str:
        """`as expected`, or how it went wrong."""
        e, g = self.expected, self.got
        if g.code in HANDLER_FAILURES:
            return "handler failure"
        if e == ACCEPTED and g.kind == "ack" and g.code in ("ACCEPTED", "DUPLICATE"):
            return "as expected"
        if (e.kind, e.code) == (g.kind, g.code):
            return "as expected" if not e.fields or g.field in e.fields else "wrong field named"
        if e not in (ACCEPTED, OK) and g.code in ("ACCEPTED", "DUPLICATE", "OK"):
            return "invalid accepted"
        if e in (ACCEPTED, OK):
            return "valid refused"
        return "other answer"


@dataclass
class FuzzTargets:
    """The two servers: `trajectory` (StreamSamples, Drain, Health; `resume` reopens it after a drain) and
    `control`, a coordinator-like ControlServer (Health, ResizePool; Drain UNIMPLEMENTED)."""

    trajectory: str
    control: str
    resume: Callable[[], None]


@dataclass
class FuzzReport:
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def mismatches(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.verdict != "as expected"]

    def by_rpc(self) -> dict[str, Counter]:
        table: dict[str, Counter] = {}
        for o in self.outcomes:
            c = table.setdefault(f"{o.rpc} → {o.target}", Counter())
            c["requests"] += 1
            c["must be refused"] += o.expected not in (ACCEPTED, OK)
            c[o.verdict] += 1
        return table


def _ack(ack: pb.Ack) -> Got:
    return Got("ack", pb.AckStatus.Name(ack.status).removeprefix("ACK_STATUS_"), ack.field or None)


def _status(error: grpc.RpcError) -> Got:
    details = error.details() or ""
    return Got("status", error.code().name, details.split(":")[0] if ":" in details else None)


class Fuzzer:
    """Sends requests as raw bytes over channels that carry the job's token, and judges every answer."""

    def __init__(self, targets: FuzzTargets, credentials: JobCredentials):
        self.targets = targets
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", 64 * 2**20)]
        self._channels = {"trajectory": credentials.channel(targets.trajectory, options),
                          "control": credentials.channel(targets.control, options)}

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()

    def __enter__(self) -> "Fuzzer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _method(self, rpc: str, target: str):
        path = f"/{SERVICES[rpc]}/{rpc}"
        if rpc == "StreamSamples":
            return self._channels[target].stream_stream(path, response_deserializer=pb.StreamReply.FromString)
        return self._channels[target].unary_unary(path)

    def run(self, cases: list[Payload | Call]) -> FuzzReport:
        """Calls one by one, then the samples `BATCH` to a stream."""
        report = FuzzReport([self._call(c) for c in cases if isinstance(c, Call)])
        payloads = [c for c in cases if isinstance(c, Payload)]
        for i in range(0, len(payloads), BATCH):
            report.outcomes += self._stream(payloads[i:i + BATCH])
        return report

    def _stream(self, items: list[Payload]) -> list[Outcome]:
        requests = [pb.SampleStreamRequest(open=pb.StreamOpen(client_id="fuzz")).SerializeToString()]
        answers: list[Got] = []
        try:
            replies = self._method("StreamSamples", "trajectory")(iter(requests + [p.request for p in items]), timeout=60)
            answers = [_ack(r.ack) for r in replies if r.WhichOneof("kind") == "ack"]
        except grpc.RpcError as exc:  # the stream ended early: each sample not acked has lost its answer
            answers += [_status(exc)] * (len(items) - len(answers))
        answers += [Got("status", "OK", "stream ended without an ack")] * (len(items) - len(answers))
        return [Outcome(p.rpc, "trajectory", p.label, p.expected, got, p.broken, p.finish_reason, int(got.code == "ACCEPTED"))
                for p, got in zip(items, answers)]

    def _call(self, case: Call) -> Outcome:
        method, acks = self._method(case.rpc, case.target), []
        try:
            if case.rpc == "StreamSamples":
                for reply in method(iter(case.requests), timeout=60):
                    acks += [_ack(reply.ack)] if reply.WhichOneof("kind") == "ack" else []
                got = acks[-1] if acks else Got("status", "OK")
            else:
                method(case.requests[0], timeout=60)
                got = Got("status", "OK")
        except grpc.RpcError as exc:
            got = _status(exc)
        finally:
            if case.rpc == "Drain" and case.target == "trajectory":
                self.targets.resume()  # whatever the answer: the next requests need a serving server
        return Outcome(case.rpc, case.target, case.label, case.expected, got,
                       queued=sum(a.code == "ACCEPTED" for a in acks))


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
    with ControlClient(targets.control, config, credentials) as control:
        resized = [control.resize_pool("rollout", n)[:2] == (True, n) for n in (2, 5, 1)]
    return {"samples accepted": (accepted, samples), "health, drain, resume": (served, 3),
            "pool resizes accepted": (sum(resized), len(resized))}
