"""gRPC transport (package sparrow.v1): trajectories worker → trainer, statistics trainer → monitor,
control coordinator → components. See docs/grpc_api.md."""

from .address import advertised_host
from .client import ControlClient, Rejection, SendReport, StatsClient, TrajectoryClient, TransportError
from .config import RetryConfig, TransportConfig
from .control import ControlHandler, ControlServicer, Health, ScheduleState
from .convert import (
    StatsRecord,
    Trajectory,
    histogram_from_proto,
    histogram_to_proto,
    schedule_from_proto,
    schedule_to_proto,
    stats_from_proto,
    stats_to_proto,
    trajectory_from_proto,
    trajectory_to_proto,
)
from .servers import MonitorServer, TrajectoryServer
from .validate import InvalidMessage, validate_histogram, validate_sample, validate_schedule, validate_stats_report

__all__ = [
    "ControlClient", "ControlHandler", "ControlServicer", "Health", "InvalidMessage", "MonitorServer", "Rejection",
    "RetryConfig", "ScheduleState", "SendReport", "StatsClient", "StatsRecord", "Trajectory", "TrajectoryClient",
    "TrajectoryServer", "TransportConfig", "TransportError", "advertised_host", "histogram_from_proto", "histogram_to_proto",
    "schedule_from_proto", "schedule_to_proto", "stats_from_proto", "stats_to_proto", "trajectory_from_proto",
    "trajectory_to_proto", "validate_histogram", "validate_sample", "validate_schedule", "validate_stats_report",
]
