"""ControlService: schedule updates, drain and health, served by every component.

A component implements `ControlHandler`; `ControlServicer` adapts it to gRPC (grpc.aio) and turns bad
requests into INVALID_ARGUMENT naming the field. Handler methods run in a worker thread: they may
block (a drain waits for pending work) and must not stall the transport loop.
"""

import asyncio
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from sparrow.protos import sparrow_v1_pb2 as pb
from sparrow.schedule import SparsitySchedule

from . import wire
from .convert import schedule_from_proto
from .validate import InvalidMessage

SERVING_STATUS = {
    "serving": pb.SERVING_STATUS_SERVING,
    "draining": pb.SERVING_STATUS_DRAINING,
    "not_serving": pb.SERVING_STATUS_NOT_SERVING,
}


@dataclass
class Health:
    status: str
    component: str
    schedule_version: int = 0
    policy_version: int = 0
    gauges: dict[str, float] = field(default_factory=dict)

    def to_proto(self) -> pb.HealthReply:
        return pb.HealthReply(
            status=SERVING_STATUS[self.status],
            component=self.component,
            schedule_version=self.schedule_version,
            policy_version=self.policy_version,
            gauges=self.gauges,
        )

    @classmethod
    def from_proto(cls, msg: pb.HealthReply) -> "Health":
        status = {v: k for k, v in SERVING_STATUS.items()}.get(msg.status, "not_serving")
        return cls(status, msg.component, msg.schedule_version, msg.policy_version, dict(msg.gauges))


class ControlHandler(Protocol):
    def update_schedule(self, schedule: SparsitySchedule) -> tuple[bool, int]:
        """Apply `schedule` unless it is older than the one in force; returns (applied, version in force)."""

    def drain(self, timeout_s: float) -> tuple[bool, int]:
        """Stop taking new work, wait up to `timeout_s` for pending work; returns (drained, pending)."""

    def health(self) -> Health: ...


class ScheduleState:
    """The schedule in force at a component; newer versions replace it, older ones are ignored.

    `on_update` (e.g. a rollout engine's `set_schedule`) runs under the lock, so updates apply in order.
    """

    def __init__(self, on_update: Callable[[SparsitySchedule], None] | None = None):
        self.schedule: SparsitySchedule | None = None
        self._on_update = on_update
        self._lock = threading.Lock()

    @property
    def version(self) -> int:
        return -1 if self.schedule is None else self.schedule.version

    def update(self, schedule: SparsitySchedule) -> tuple[bool, int]:
        with self._lock:
            if self.schedule is not None and schedule.version <= self.schedule.version:
                return schedule.version == self.schedule.version and schedule == self.schedule, self.schedule.version
            if self._on_update is not None:
                self._on_update(schedule)
            self.schedule = schedule
            return True, schedule.version


class ControlServicer:
    def __init__(self, handler: ControlHandler):
        self.handler = handler

    def service(self) -> grpc.GenericRpcHandler:
        return wire.service(pb.DESCRIPTOR.services_by_name["ControlService"].full_name, {
            "UpdateSchedule": wire.unary_unary(self.UpdateSchedule, pb.UpdateScheduleRequest, pb.UpdateScheduleReply),
            "Drain": wire.unary_unary(self.Drain, pb.DrainRequest, pb.DrainReply),
            "Health": wire.unary_unary(self.Health, pb.HealthRequest, pb.HealthReply),
        })

    @staticmethod
    async def _decoded(request, context: grpc.aio.ServicerContext):
        if isinstance(request, wire.Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        return request

    async def UpdateSchedule(self, request, context: grpc.aio.ServicerContext) -> pb.UpdateScheduleReply:
        request = await self._decoded(request, context)
        if not request.HasField("schedule"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "schedule: missing")
        try:
            schedule = schedule_from_proto(request.schedule)
        except InvalidMessage as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        applied, version = await asyncio.to_thread(self.handler.update_schedule, schedule)
        return pb.UpdateScheduleReply(applied=applied, current_version=version)

    async def Drain(self, request, context: grpc.aio.ServicerContext) -> pb.DrainReply:
        request = await self._decoded(request, context)
        if not (math.isfinite(request.timeout_s) and request.timeout_s >= 0):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s: ={request.timeout_s} must be a finite number >= 0")
        remaining = context.time_remaining()  # no use waiting past the caller's deadline
        timeout_s = request.timeout_s if remaining is None else min(request.timeout_s, max(remaining, 0.0))
        drained, pending = await asyncio.to_thread(self.handler.drain, timeout_s)
        return pb.DrainReply(drained=drained, pending=pending)

    async def Health(self, request, context: grpc.aio.ServicerContext) -> pb.HealthReply:
        await self._decoded(request, context)
        return (await asyncio.to_thread(self.handler.health)).to_proto()
