"""ControlService: drain and health, for operators and observers; pool resizes, served by the coordinator.

Two servers serve it: the trainer pool's trajectory server (drain, health: `servers.TrajectoryServer`)
and the coordinator (health and `sparrow pool resize`: `endpoint.JobControlServer`, the driver as
handler). The job's own control (schedules, weights, leases, statistics) is Ray calls, not this service.

A component implements `ControlHandler`; `ControlServicer` adapts it to gRPC (grpc.aio) and turns bad
requests into INVALID_ARGUMENT naming the field. Handler methods run in a worker thread, so a slow one
does not stall the transport loop; none holds a thread while a drain waits (the servicer waits on the
loop, asking the handler every DRAIN_POLL_S), so any number of waiting drains leave Health and resizes
their threads. A handler without `resize_pool`, or whose method raises NotImplementedError, answers
that RPC with UNIMPLEMENTED.

No torch here, so the `sparrow pool` client starts fast.
"""

import asyncio
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from sparrow.protos import sparrow_v1_pb2 as pb

from . import wire
from .validate import InvalidMessage, validate_resize_pool

DRAIN_POLL_S = 0.05
"""How often a waiting Drain asks its handler again (`drain(0.0)`)."""
CONTROL_REQUEST_MAX_BYTES = 4096
"""Largest ControlService request a server parses, whatever `max_message_mb` allows samples: a ResizePoolRequest
is at most ~1 KiB (a pool name of <= 256 characters and a size), the others a few bytes. Larger ones are
answered RESOURCE_EXHAUSTED unparsed."""

SERVING_STATUS = {
    "serving": pb.SERVING_STATUS_SERVING,
    "draining": pb.SERVING_STATUS_DRAINING,
    "not_serving": pb.SERVING_STATUS_NOT_SERVING,
}


@dataclass
class PoolStatus:
    """One worker pool as the coordinator reports it in `Health.pools`."""

    pool: str
    target: int
    serving: int
    joining: int = 0
    retiring: int = 0
    resizable: bool = False

    def to_proto(self) -> pb.PoolStatus:
        return pb.PoolStatus(pool=self.pool, target=self.target, serving=self.serving, joining=self.joining,
                             retiring=self.retiring, resizable=self.resizable)

    @classmethod
    def from_proto(cls, msg: pb.PoolStatus) -> "PoolStatus":
        return cls(msg.pool, msg.target, msg.serving, msg.joining, msg.retiring, msg.resizable)


@dataclass
class Health:
    status: str
    component: str
    schedule_version: int = 0
    policy_version: int = 0
    gauges: dict[str, float] = field(default_factory=dict)
    pools: list[PoolStatus] = field(default_factory=list)
    """The coordinator's pools; empty for other components."""

    def to_proto(self) -> pb.HealthReply:
        return pb.HealthReply(
            status=SERVING_STATUS[self.status],
            component=self.component,
            schedule_version=self.schedule_version,
            policy_version=self.policy_version,
            gauges=self.gauges,
            pools=[p.to_proto() for p in self.pools],
        )

    @classmethod
    def from_proto(cls, msg: pb.HealthReply) -> "Health":
        status = {v: k for k, v in SERVING_STATUS.items()}.get(msg.status, "not_serving")
        return cls(status, msg.component, msg.schedule_version, msg.policy_version, dict(msg.gauges),
                   [PoolStatus.from_proto(p) for p in msg.pools])


class ControlHandler(Protocol):
    def drain(self, timeout_s: float) -> tuple[bool, int]:
        """Stop taking new work, wait up to `timeout_s` for pending work; returns (drained, pending).
        Idempotent; the servicer calls it with 0 (answer at once) and does the waiting itself."""

    def health(self) -> Health: ...

    def resize_pool(self, pool: str, size: int) -> tuple[bool, int, str]:
        """Optional (the coordinator's): set `pool`'s target size; returns (accepted, target in force, message).

        Called with a validated request (`pool` is "rollout", 1 <= size <= MAX_POOL_SIZE) on a worker
        thread while the job runs, so it records the target and returns at once; the job applies it.
        (False, current target, why) refuses a valid request. Components without it answer UNIMPLEMENTED."""


class ResizeRequests:
    """Thread-safe mailbox between `resize_pool` (transport threads) and the loop that applies sizes:
    the latest target asked for per pool; `take()` hands each over once."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pending: dict[str, int] = {}

    def put(self, pool: str, size: int) -> None:
        with self._lock:
            self._pending[pool] = size

    def take(self, pool: str) -> int | None:
        """The size asked for since the last take (the latest of several), or None."""
        with self._lock:
            return self._pending.pop(pool, None)


def _unimplemented(what: str, handler) -> str:
    name = getattr(handler, "component", None) or type(handler).__name__
    if what == "ResizePool":
        return (f"ResizePool: this component ({name}) does not resize pools; the coordinator does: "
                "`sparrow pool resize RUN_DIR --rollout N` dials the address in RUN_DIR/control/endpoint.json")
    return f"{what}: not served by this component ({name})"


class ControlServicer:
    def __init__(self, handler: ControlHandler):
        self.handler = handler

    def service(self) -> grpc.GenericRpcHandler:
        return wire.service(pb.DESCRIPTOR.services_by_name["ControlService"].full_name, {
            "Drain": wire.unary_unary(self.Drain, pb.DrainRequest, pb.DrainReply, CONTROL_REQUEST_MAX_BYTES),
            "Health": wire.unary_unary(self.Health, pb.HealthRequest, pb.HealthReply, CONTROL_REQUEST_MAX_BYTES),
            "ResizePool": wire.unary_unary(self.ResizePool, pb.ResizePoolRequest, pb.ResizePoolReply, CONTROL_REQUEST_MAX_BYTES),
        })

    @staticmethod
    async def _decoded(request, context: grpc.aio.ServicerContext):
        if isinstance(request, wire.Unreadable):
            await context.abort(request.code, request.message)
        return request

    async def _call(self, context: grpc.aio.ServicerContext, rpc: str, method: Callable, *args):
        """`method(*args)` on a worker thread; NotImplementedError answers UNIMPLEMENTED with its message."""
        try:
            return await asyncio.to_thread(method, *args)
        except NotImplementedError as exc:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{rpc}: {exc}" if str(exc) else _unimplemented(rpc, self.handler))

    async def Drain(self, request, context: grpc.aio.ServicerContext) -> pb.DrainReply:
        request = await self._decoded(request, context)
        if not (math.isfinite(request.timeout_s) and request.timeout_s >= 0):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s: ={request.timeout_s} must be a finite number >= 0")
        remaining = context.time_remaining()  # no use waiting past the caller's deadline
        timeout_s = request.timeout_s if remaining is None else min(request.timeout_s, max(remaining, 0.0))
        clock = asyncio.get_running_loop().time
        deadline = clock() + timeout_s
        while True:  # waits on the loop, not in a thread: waiting drains cannot starve other control calls
            drained, pending = await self._call(context, "Drain", self.handler.drain, 0.0)
            if drained or clock() >= deadline:
                return pb.DrainReply(drained=drained, pending=pending)
            await asyncio.sleep(min(DRAIN_POLL_S, deadline - clock()))

    async def Health(self, request, context: grpc.aio.ServicerContext) -> pb.HealthReply:
        await self._decoded(request, context)
        return (await self._call(context, "Health", self.handler.health)).to_proto()

    async def ResizePool(self, request, context: grpc.aio.ServicerContext) -> pb.ResizePoolReply:
        """Decoded, then UNIMPLEMENTED unless the handler resizes, then validated, then the handler."""
        request = await self._decoded(request, context)
        resize = getattr(self.handler, "resize_pool", None)
        if resize is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, _unimplemented("ResizePool", self.handler))
        try:
            validate_resize_pool(request)
        except InvalidMessage as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        accepted, size, message = await self._call(context, "ResizePool", resize, request.pool, request.size)
        return pb.ResizePoolReply(accepted=accepted, size=size, message=message)
