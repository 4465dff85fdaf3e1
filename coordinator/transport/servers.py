"""The two ingest servers: trajectories (rollout workers → trainer pool) and statistics
(trainers → coordinator monitor). Each also serves ControlService for its own component."""

from collections.abc import Callable
from concurrent import futures

import grpc

from sparrow.protos import sparrow_v1_pb2_grpc as pb_grpc
from sparrow.schedule import SparsitySchedule

from .config import TransportConfig
from .control import ControlServicer, Health, ScheduleState
from .convert import stats_from_proto, trajectory_from_proto
from .ingest import AckedIngest
from .validate import validate_sample, validate_stats_report


class _IngestServer:
    """A gRPC server around one AckedIngest, plus ControlService (drain, health, schedule)."""

    component = ""

    def __init__(self, config: TransportConfig, ingest: AckedIngest, on_schedule: Callable[[SparsitySchedule], None] | None):
        self.config = config
        self.ingest = ingest
        self.schedule_state = ScheduleState(on_schedule)
        self.port: int | None = None
        self._server: grpc.Server | None = None

    def _register(self, server: grpc.Server) -> None:
        raise NotImplementedError

    def start(self) -> int:
        """Bind and serve; returns the port (useful with port 0)."""
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self.config.max_workers, thread_name_prefix=self.component),
            options=self.config.grpc_options(),
        )
        self._register(server)
        pb_grpc.add_ControlServiceServicer_to_server(ControlServicer(self), server)
        port = server.add_insecure_port(self.config.address)
        if port == 0:
            raise OSError(f"{self.component}: cannot bind {self.config.address}; pick another transport.port")
        server.start()
        self._server, self.port = server, port
        return port

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop serving; handlers blocked on a full queue give up (their senders resend elsewhere)."""
        self.ingest.stopping.set()
        if self._server is not None:
            self._server.stop(grace).wait()
            self._server = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop(grace=0)

    def get(self, timeout: float | None = None):
        return self.ingest.get(timeout)

    def get_batch(self, max_items: int, timeout: float | None = None) -> list:
        return self.ingest.get_batch(max_items, timeout)

    @property
    def queue_depth(self) -> int:
        return self.ingest.queue.qsize()

    def stats(self) -> dict[str, float]:
        return self.ingest.stats()

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

    def __init__(self, config: TransportConfig, server_id: str = "trajectory-server",
                 on_schedule: Callable[[SparsitySchedule], None] | None = None):
        ingest = AckedIngest(
            payload="sample",
            id_field="sample_id",
            validate=lambda msg: validate_sample(msg, config),
            convert=trajectory_from_proto,
            capacity=config.queue_capacity,
            dedupe_window=config.dedupe_window,
            window=config.stream_window,
            server_id=server_id,
        )
        super().__init__(config, ingest, on_schedule)

    def _register(self, server: grpc.Server) -> None:
        servicer = pb_grpc.TrajectoryServiceServicer()
        servicer.StreamSamples = self.ingest.serve
        pb_grpc.add_TrajectoryServiceServicer_to_server(servicer, server)


class MonitorServer(_IngestServer):
    """Coordinator endpoint for dense-recompute statistics; `get` / `get_batch` return `StatsRecord`s."""

    component = "monitor"

    def __init__(self, config: TransportConfig, server_id: str = "monitor",
                 on_schedule: Callable[[SparsitySchedule], None] | None = None):
        ingest = AckedIngest(
            payload="report",
            id_field="report_id",
            validate=validate_stats_report,
            convert=stats_from_proto,
            capacity=config.queue_capacity,
            dedupe_window=config.dedupe_window,
            window=config.stream_window,
            server_id=server_id,
        )
        super().__init__(config, ingest, on_schedule)

    def _register(self, server: grpc.Server) -> None:
        servicer = pb_grpc.MonitorServiceServicer()
        servicer.StreamStats = self.ingest.serve
        pb_grpc.add_MonitorServiceServicer_to_server(servicer, server)
