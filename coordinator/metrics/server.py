"""Serve a SparrowMetrics registry on /metrics, trying successive ports when one is taken."""

from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

from .config import MetricsConfig
from .registry import SparrowMetrics


@dataclass
class MetricsServer:
    host: str
    port: int
    _server: WSGIServer
    _thread: Thread

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(metrics: SparrowMetrics, config: MetricsConfig | None = None) -> MetricsServer:
    config = config or metrics.config
    ports = [0] if config.port == 0 else range(config.port, min(config.port + config.port_search, 65536))
    for port in ports:
        try:
            server, thread = start_http_server(port, addr=config.host, registry=metrics.registry)
        except OSError:
            continue
        return MetricsServer(config.host, server.server_port, server, thread)
    raise OSError(
        f"metrics: ports {config.port}..{config.port + config.port_search - 1} on {config.host} are all in use; "
        "set metrics.port to a free port (0 = any free port) or raise metrics.port_search"
    )
