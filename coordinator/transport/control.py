"""ControlService: schedule updates, drain and health, served by every component.

A component implements `ControlHandler`; `ControlServicer` adapts it to gRPC and turns bad requests
into INVALID_ARGUMENT naming the field.
"""

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from sparrow.protos import sparrow_v1_pb2 as pb
from sparrow.protos import sparrow_v1_pb2_grpc as pb_grpc
from sparrow.schedule import SparsitySchedule

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


class ControlServicer(pb_grpc.ControlServiceServicer):
    def __init__(self, handler: ControlHandler):
        self.handler = handler

    def UpdateSchedule(self, request: pb.UpdateScheduleRequest, context: grpc.ServicerContext) -> pb.UpdateScheduleReply:
        if not request.HasField("schedule"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "schedule: missing")
        try:
            schedule = schedule_from_proto(request.schedule)
        except InvalidMessage as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        applied, version = self.handler.update_schedule(schedule)
        return pb.UpdateScheduleReply(applied=applied, current_version=version)

    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext) -> pb.DrainReply:
        if not (math.isfinite(request.timeout_s) and request.timeout_s >= 0):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"timeout_s: ={request.timeout_s} must be a finite number >= 0")
        drained, pending = self.handler.drain(request.timeout_s)
        return pb.DrainReply(drained=drained, pending=pending)

    def Health(self, request: pb.HealthRequest, context: grpc.ServicerContext) -> pb.HealthReply:
        return self.handler.health().to_proto()
