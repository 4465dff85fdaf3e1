"""The gRPC servers: `TrajectoryServer` (rollout workers → trainer pool, plus ControlService for drain and
health) and `ControlServer`, ControlService alone (the coordinator's, for `sparrow pool`, through
`endpoint.JobControlServer`).

Every server is a grpc.aio server on the process's transport loop (`loop.py`) behind the job token
(`auth.TokenCheck`) and, when the job uses TLS, a certificate for the addresses it is dialled at.
Its API stays synchronous: `start() -> port`, `stop()`, `get`, `get_batch`, `stats()`.
"""

import grpc

from sparrow.protos import sparrow_v1_pb2 as pb

from . import loop, wire
from .auth import TokenCheck
from .config import TransportConfig
from .control import ControlHandler, ControlServicer, Health
from .convert import trajectory_from_proto
from .ingest import AckedIngest
from .security import JobCredentials
from .validate import validate_sample


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
    """ControlService alone, for a component that receives no stream (the coordinator)."""

    component = "control"

    def __init__(self, config: TransportConfig, credentials: JobCredentials, handler: ControlHandler):
        super().__init__(config, credentials)
        self.handler = handler

    def _services(self) -> list[grpc.GenericRpcHandler]:
        return [ControlServicer(self.handler).service()]


class TrajectoryServer(_GrpcServer):
    """Trainer-pool endpoint: TrajectoryService around one AckedIngest, plus ControlService (drain, health)
    with itself as the handler. `get` / `get_batch` return `Trajectory` objects in arrival order."""

    component = "trajectory-server"

    def __init__(self, config: TransportConfig, credentials: JobCredentials, server_id: str = "trajectory-server"):
        super().__init__(config, credentials)
        self.ingest = AckedIngest(
            payload="sample",
            id_field="sample_id",
            validate=lambda msg: validate_sample(msg, config),
            convert=trajectory_from_proto,
            config=config,
            server_id=server_id,
        )

    def _services(self) -> list[grpc.GenericRpcHandler]:
        stream = wire.stream_stream(self.ingest.serve, pb.SampleStreamRequest, pb.StreamReply)
        service = pb.DESCRIPTOR.services_by_name["TrajectoryService"].full_name
        return [wire.service(service, {"StreamSamples": stream}), ControlServicer(self).service()]

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

    # ControlHandler
    def drain(self, timeout_s: float) -> tuple[bool, int]:
        """Refuse new samples (acked UNAVAILABLE) and wait for the consumer to empty the queue."""
        self.ingest.draining.set()
        drained = self.ingest.wait_empty(timeout_s)
        return drained, self.queue_depth

    def resume(self) -> None:
        self.ingest.draining.clear()

    def health(self) -> Health:
        """Status and gauges; no versions (the trainer's schedule and weights are the coordinator's to report)."""
        status = "not_serving" if self._server is None else "draining" if self.ingest.draining.is_set() else "serving"
        return Health(status, self.component, 0, 0, self.stats())
