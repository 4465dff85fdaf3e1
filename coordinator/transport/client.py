"""Clients: rollout workers send trajectories (`TrajectoryClient`); operators and tests call ControlService
(`ControlClient`: `sparrow pool`, a drain of the trajectory server).

`send()` keeps at most the granted window of messages in flight, matches the in-order acks, and on a
broken stream reopens one (exponential backoff) and resends whatever was not acknowledged. Resends
are safe because the server de-duplicates by id: a sample whose ack was lost is acked DUPLICATE.

The conversions (torch) load on a client's first send, so `ControlClient` alone (`sparrow pool`) starts fast.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from sparrow.protos import sparrow_v1_pb2 as pb
from sparrow.protos import sparrow_v1_pb2_grpc as pb_grpc

from .config import TransportConfig
from .control import Health
from .security import JobCredentials

if TYPE_CHECKING:
    from .convert import Trajectory

RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.CANCELLED,
}
POLL_S = 0.05


class TransportError(RuntimeError):
    """A send or call that failed for good (non-retryable status, or retries exhausted); `code` is the
    gRPC status of the last failure, when there was one."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, details: str = ""):
        super().__init__(message)
        self.code, self.details = code, details


@dataclass
class Rejection:
    id: str
    field: str
    message: str


@dataclass
class SendReport:
    accepted: int = 0
    duplicate: int = 0
    rejected: list[Rejection] = field(default_factory=list)
    streams: int = 0  # streams opened: 1 + reconnects


class _Stream:
    """Shared state of one open stream between the request thread and the ack loop."""

    def __init__(self):
        self.cond = threading.Condition()
        self.credits = 0
        self.in_flight: deque = deque()
        self.stop_sending = False
        self.exhausted = False


class _AckedSender:
    def __init__(self, call: Callable, open_request, wrap: Callable, id_of: Callable, config: TransportConfig):
        self._call, self._open_request, self._wrap, self._id_of = call, open_request, wrap, id_of
        self._retry = config.retry
        self._lock = threading.Lock()

    def send(self, messages: Iterable) -> SendReport:
        with self._lock:
            source, resend, report = iter(messages), deque(), SendReport()
            failures, backoff = 0, self._retry.initial_backoff_s
            while True:
                progress_before = report.accepted + report.duplicate + len(report.rejected)
                done, error = self._one_stream(source, resend, report)
                if done:
                    return report
                if report.accepted + report.duplicate + len(report.rejected) > progress_before:
                    failures, backoff = 0, self._retry.initial_backoff_s
                failures += 1
                if failures >= self._retry.max_attempts:
                    raise TransportError(
                        f"gave up after {failures} failed streams ({len(resend)} messages unsent); last error: {error}"
                    )
                time.sleep(backoff)
                backoff = min(2 * backoff, self._retry.max_backoff_s)

    def _requests(self, s: _Stream, source: Iterator, resend: deque) -> Iterator:
        yield self._open_request
        while True:
            with s.cond:
                while s.credits <= 0 and not s.stop_sending:
                    s.cond.wait(POLL_S)
                if s.stop_sending:
                    return
                msg = resend.popleft() if resend else next(source, None)
                if msg is None:
                    s.exhausted = True
                    return
                s.in_flight.append(msg)
                s.credits -= 1
            yield self._wrap(msg)

    def _one_stream(self, source: Iterator, resend: deque, report: SendReport) -> tuple[bool, str]:
        s, deferred = _Stream(), []
        report.streams += 1
        error = ""
        try:
            for reply in self._call(self._requests(s, source, resend)):
                with s.cond:
                    if reply.WhichOneof("kind") == "grant":
                        s.credits = reply.grant.window
                    else:
                        self._on_ack(reply.ack, s, report, deferred)
                    s.cond.notify_all()
            if s.in_flight:
                error = f"stream ended with {len(s.in_flight)} messages unacknowledged"
        except grpc.RpcError as exc:
            if exc.code() not in RETRYABLE:
                raise TransportError(f"{exc.code().name}: {exc.details()}", exc.code(), exc.details() or "") from None
            error = f"{exc.code().name}: {exc.details()}"
        finally:
            with s.cond:
                s.stop_sending = True
                s.cond.notify_all()
                # Unacknowledged and deferred messages go first on the next stream, in order.
                resend.extendleft(reversed(list(s.in_flight) + deferred))
                s.in_flight.clear()
        if deferred and not error:
            error = "server is draining (UNAVAILABLE acks)"
        return (s.exhausted and not resend and not error), error

    def _on_ack(self, ack: pb.Ack, s: _Stream, report: SendReport, deferred: list) -> None:
        msg = s.in_flight.popleft()
        if ack.id != self._id_of(msg):
            raise TransportError(f"protocol error: ack for {ack.id!r} but {self._id_of(msg)!r} was next in line")
        s.credits += 1
        if ack.status == pb.ACK_STATUS_ACCEPTED:
            report.accepted += 1
        elif ack.status == pb.ACK_STATUS_DUPLICATE:
            report.duplicate += 1
        elif ack.status == pb.ACK_STATUS_INVALID_ARGUMENT:
            report.rejected.append(Rejection(ack.id, ack.field, ack.message))
        else:  # draining: resend on a later stream, and stop sending on this one
            deferred.append(msg)
            s.stop_sending = True


class _Client:
    """A channel that presents the job's token (over TLS when the job uses it)."""

    def __init__(self, address: str, config: TransportConfig, credentials: JobCredentials):
        self.config = config
        self.channel = credentials.channel(address, config.grpc_options())

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class TrajectoryClient(_Client):
    """A rollout worker's connection to a TrajectoryServer."""

    def __init__(self, address: str, config: TransportConfig, credentials: JobCredentials, client_id: str = "worker"):
        super().__init__(address, config, credentials)
        self._sender = _AckedSender(
            pb_grpc.TrajectoryServiceStub(self.channel).StreamSamples,
            open_request=pb.SampleStreamRequest(open=pb.StreamOpen(client_id=client_id)),
            wrap=lambda msg: pb.SampleStreamRequest(sample=msg),
            id_of=lambda msg: msg.sample_id,
            config=self.config,
        )

    def send(self, trajectories: Iterable[Trajectory | pb.Sample]) -> SendReport:
        """Send and wait for every ack. Invalid samples come back in `report.rejected`, not retried."""
        from .convert import trajectory_to_proto

        return self._sender.send(t if isinstance(t, pb.Sample) else trajectory_to_proto(t) for t in trajectories)


class ControlClient(_Client):
    """A handle on one server's ControlService (unary calls, retried on UNAVAILABLE): the coordinator's
    (`sparrow pool`) or the trajectory server's."""

    def __init__(self, address: str, config: TransportConfig, credentials: JobCredentials, timeout_s: float = 10.0):
        super().__init__(address, config, credentials)
        self._stub = pb_grpc.ControlServiceStub(self.channel)
        self._timeout_s = timeout_s

    def _call(self, method: Callable, request, timeout_s: float):
        retry, backoff = self.config.retry, self.config.retry.initial_backoff_s
        for attempt in range(1, retry.max_attempts + 1):
            try:
                return method(request, timeout=timeout_s)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == retry.max_attempts:
                    raise TransportError(f"{exc.code().name}: {exc.details()}", exc.code(), exc.details() or "") from None
            time.sleep(backoff)
            backoff = min(2 * backoff, retry.max_backoff_s)

    def drain(self, timeout_s: float = 0.0) -> tuple[bool, int]:
        reply = self._call(self._stub.Drain, pb.DrainRequest(timeout_s=timeout_s), self._timeout_s + timeout_s)
        return reply.drained, reply.pending

    def health(self) -> Health:
        return Health.from_proto(self._call(self._stub.Health, pb.HealthRequest(), self._timeout_s))

    def resize_pool(self, pool: str, size: int) -> tuple[bool, int, str]:
        """Ask the coordinator to resize `pool` to `size` workers; returns (accepted, target in force, message).
        Safe to retry (it sets a target); INVALID_ARGUMENT / UNIMPLEMENTED raise TransportError with `code`."""
        reply = self._call(self._stub.ResizePool, pb.ResizePoolRequest(pool=pool, size=size), self._timeout_s)
        return reply.accepted, reply.size, reply.message
