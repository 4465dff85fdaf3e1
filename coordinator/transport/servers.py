"""The gRPC servers: trajectories (rollout workers → trainer pool), statistics (trainers → coordinator
monitor), and ControlService alone (rollout workers; the coordinator's, for `sparrow pool`, through
`endpoint.JobControlServer`). Both ingest servers also serve ControlService.

Every server is a grpc.aio server on the process's transport loop (`loop.py`) behind the job token
(`auth.TokenCheck`) and, when the job uses TLS, a certificate for the addresses it is dialled at.
Its API stays synchronous: `start() -> port`, `stop()`, `get`, `get_batch`, `stats()`.
"""

from collections.abc import Callable

import grpc

from sparrow.protos import sparrow_v1_pb2 as pb
from sparrow.schedule import SparsitySchedule

from . import loop, wire
from .auth import TokenCheck
from .config import TransportConfig
from .control import ControlHandler, ControlServicer, Health, ScheduleState
from .convert import stats_from_proto, trajectory_from_proto
from .ingest import AckedIngest
from .security import JobCredentials
from .validate import validate_sample, validate_stats_report


class _GrpcServer:
    """A grpc.aio server bound to `config.address`, refusing calls without the job token."""

    component = ""

    def __init__(self, config: TransportConfig, credentials: JobCredentials):
        self.config, self.credentials = config, credentials
        self.port: int | None = None
        self.unauthenticated = 0
        self._server: grpc.aio.Server | None = None

    def _services(self) -> list[grpc.GenericRpcHandler]:
        raise NotImplementedError

    def _refused(self) -> None:
        self.unauthenticated += 1

    def start(self) -> int:
        """Bind and serve; returns the port (useful with port 0)."""
        tls = self.credentials.server_credentials(self.config.host)
        self._server, self.port = loop.run(self._start(tls))
        return self.port

    async def _start(self, tls: grpc.ServerCredentials | None) -> tuple[grpc.aio.Server, int]:
        server = grpc.aio.server(
            interceptors=[TokenCheck(self.credentials.token, self._refused)], options=self.config.server_options()
        )
        server.add_generic_rpc_handlers(self._services())
        address = self.config.address
        try:
            port = server.add_secure_port(address, tls) if tls is not None else server.add_insecure_port(address)
        except RuntimeError:
            port = 0
        if port == 0:
            raise OSError(f"{self.component}: cannot bind {address}; pick another transport.port")
        await server.start()
        return server, port

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def stats(self) -> dict[str, float]:
        return {"unauthenticated": float(self.unauthenticated)}

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving; calls still running after `grace` seconds are cancelled (senders resend elsewhere)."""
        if self._server is not None:
            loop.run(self._server.stop(grace))
            self._server = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop(grace=0)


class ControlServer(_GrpcServer):
    """ControlService alone, for a component that receives no stream (a rollout worker, the coordinator)."""

    component = "control"

    def __init__(self, config: TransportConfig, credentials: JobCredentials, handler: ControlHandler):
        super().__init__(config, credentials)
        self.handler = handler

    def _services(self) -> list[grpc.GenericRpcHandler]:
        return [ControlServicer(self.handler).service()]


class _IngestServer(_GrpcServer):
    """A server around one AckedIngest, plus ControlService (drain, health, schedule)."""

    service_name = ""
    method = ""
    request_type: type = type(None)

    def __init__(self, config: TransportConfig, credentials: JobCredentials, ingest: AckedIngest,
                 on_schedule: Callable[[SparsitySchedule], None] | None):
        super().__init__(config, credentials)
        self.ingest = ingest
        self.schedule_state = ScheduleState(on_schedule)

    def _services(self) -> list[grpc.GenericRpcHandler]:
        stream = wire.stream_stream(self.ingest.serve, self.request_type, pb.StreamReply)
        return [wire.service(self.service_name, {self.method: stream}), ControlServicer(self).service()]

    def start(self) -> int:
        self.ingest.open()
        try:
            return super().start()
        except BaseException:
            self.ingest.close()
            raise

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving; handlers still waiting on a full queue after `grace` give up (their senders resend)."""
        super().stop(grace)
        self.ingest.close()

    def get(self, timeout: float | None = None):
        return self.ingest.get(timeout)

    def get_batch(self, max_items: int, timeout: float | None = None) -> list:
        return self.ingest.get_batch(max_items, timeout)

    @property
    def queue_depth(self) -> int:
        return self.ingest.queue.qsize()

    def stats(self) -> dict[str, float]:
        return {**self.ingest.stats(), **super().stats()}

    @property
    def schedule(self) -> SparsitySchedule | None:
        return self.schedule_state.schedule

    # ControlHandler
    def update_schedule(self, schedule: SparsitySchedule) -> tuple[bool, int]:
        return self.schedule_state.update(schedule)

    def drain(self, timeout_s: float) -> tuple[bool, int]:
        """Refuse new messages (acked UNAVAILABLE) and wait for the consumer to empty the queue."""
        self.ingest.draining.set()
        drained = self.ingest.wait_empty(timeout_s)
        return drained, self.queue_depth

    def resume(self) -> None:
        self.ingest.draining.clear()

    def health(self) -> Health:
        status = "not_serving" if self._server is None else "draining" if self.ingest.draining.is_set() else "serving"
        return Health(status, self.component, max(self.schedule_state.version, 0), 0, self.stats())


class TrajectoryServer(_IngestServer):
    """Trainer-pool endpoint; `get` / `get_batch` return `Trajectory` objects in arrival order."""

    component = "trajectory-server"
    service_name = pb.DESCRIPTOR.services_by_name["TrajectoryService"].full_name
    method = "StreamSamples"
    request_type = pb.SampleStreamRequest

    def __init__(self, config: TransportConfig, credentials: JobCredentials, server_id: str = "trajectory-server",
                 on_schedule: Callable[[SparsitySchedule], None] | None = None):
        ingest = AckedIngest(
            payload="sample",
            id_field="sample_id",
            validate=lambda msg: validate_sample(msg, config),
            convert=trajectory_from_proto,
            config=config,
            server_id=server_id,
        )
        super().__init__(config, credentials, ingest, on_schedule)


class MonitorServer(_IngestServer):
    """Coordinator endpoint for dense-recompute statistics; `get` / `get_batch` return `StatsRecord`s."""

    component = "monitor"
    service_name = pb.DESCRIPTOR.services_by_name["MonitorService"].full_name
    method = "StreamStats"
    request_type = pb.StatsStreamRequest

    def __init__(self, config: TransportConfig, credentials: JobCredentials, server_id: str = "monitor",
                 on_schedule: Callable[[SparsitySchedule], None] | None = None):
        ingest = AckedIngest(
            payload="report",
            id_field="report_id",
            validate=validate_stats_report,
            convert=stats_from_proto,
            config=config,
            server_id=server_id,
        )
        super().__init__(config, credentials, ingest, on_schedule)
