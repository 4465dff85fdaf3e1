"""gRPC transport (package sparrow.v1): trajectories worker → trainer, statistics trainer → coordinator
monitor, control coordinator → components and user → coordinator (`sparrow pool`). See docs/grpc_api.md.

Names load on first use (PEP 562), so `sparrow pool` imports the control client without the
conversions' torch, and `from sparrow.coordinator.transport import X` works as before.
"""

import importlib

_WHERE = {
    "address": ("advertised_host",),
    "client": ("ControlClient", "Rejection", "SendReport", "StatsClient", "TrajectoryClient", "TransportError"),
    "config": ("RetryConfig", "SecurityConfig", "TransportConfig"),
    "control": ("ControlHandler", "ControlServicer", "Health", "PoolStatus", "ResizeRequests", "ScheduleState"),
    "convert": ("StatsRecord", "Trajectory", "histogram_from_proto", "histogram_to_proto", "schedule_from_proto",
                "schedule_to_proto", "stats_from_proto", "stats_to_proto", "trajectory_from_proto", "trajectory_to_proto"),
    "endpoint": ("Endpoint", "EndpointError", "JobControlServer", "read_endpoint"),
    "security": ("CredentialsError", "JobCredentials"),
    "servers": ("ControlServer", "MonitorServer", "TrajectoryServer"),
    "validate": ("InvalidMessage", "validate_histogram", "validate_resize_pool", "validate_sample", "validate_schedule",
                 "validate_stats_report"),
}
_MODULE_OF = {name: module for module, names in _WHERE.items() for name in names}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
