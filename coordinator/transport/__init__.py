"""gRPC transport (package sparrow.v1): trajectories worker → trainer, statistics trainer → monitor,
control coordinator → components. See docs/grpc_api.md."""

from .client import ControlClient, Rejection, SendReport, StatsClient, TrajectoryClient, TransportError
from .config import RetryConfig, SecurityConfig, TransportConfig
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
from .security import CredentialsError, JobCredentials
from .servers import ControlServer, MonitorServer, TrajectoryServer
from .validate import InvalidMessage, validate_histogram, validate_sample, validate_schedule, validate_stats_report

__all__ = [
    "ControlClient", "ControlHandler", "ControlServer", "ControlServicer", "CredentialsError", "Health", "InvalidMessage",
    "JobCredentials", "MonitorServer", "Rejection", "RetryConfig", "ScheduleState", "SecurityConfig", "SendReport", "StatsClient", "StatsRecord", "Trajectory", "TrajectoryClient",
    "TrajectoryServer", "TransportConfig", "TransportError", "histogram_from_proto", "histogram_to_proto",
    "schedule_from_proto", "schedule_to_proto", "stats_from_proto", "stats_to_proto", "trajectory_from_proto",
    "trajectory_to_proto", "validate_histogram", "validate_sample", "validate_schedule", "validate_stats_report",
]
