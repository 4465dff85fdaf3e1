"""gRPC transport (package sparrow.v1): trajectories rollout worker → trainer pool, and ControlService for
operators and observers (`sparrow pool` → the coordinator; drain and health of the trajectory server).
Everything else inside a job travels over Ray. See docs/grpc_api.md.

Names load on first use (PEP 562), so `sparrow pool` imports the control client without the
conversions' torch, and `from sparrow.coordinator.transport import X` works as before.
"""

import importlib

_WHERE = {
    "address": ("advertised_host",),
    "client": ("ControlClient", "Rejection", "SendReport", "TrajectoryClient", "TransportError"),
    "config": ("RetryConfig", "SecurityConfig", "TransportConfig"),
    "control": ("ControlHandler", "ControlServicer", "Health", "PoolStatus", "ResizeRequests"),
    "convert": ("Trajectory", "trajectory_from_proto", "trajectory_to_proto"),
    "endpoint": ("Endpoint", "EndpointError", "JobControlServer", "read_endpoint"),
    "security": ("CredentialsError", "JobCredentials"),
    "servers": ("ControlServer", "TrajectoryServer"),
    "validate": ("InvalidMessage", "validate_resize_pool", "validate_sample"),
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
