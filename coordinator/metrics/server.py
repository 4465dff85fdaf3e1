"""Serve a SparrowMetrics registry on /metrics, trying successive ports when one is taken."""

import socket
from dataclasses import dataclass
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

from .config import MetricsConfig
from .registry import SparrowMetrics

WILDCARDS = ("0.0.0.0", "::", "")


def reachable_host(bind_host: str) -> str:
    """The address another host scrapes a server bound to `bind_host` at: the node's IP (as Ray sees
    it) for a wildcard bind, else the bind address itself."""
    if bind_host not in WILDCARDS:
        return bind_host
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return socket.gethostname()


@dataclass
class MetricsServer:
    host: str
    port: int
    _server: WSGIServer
    _thread: Thread
    advertised_host: str | None = None

    @property
    def url(self) -> str:
        """Where Prometheus scrapes this process (the node's address when bound to a wildcard)."""
        host = self.advertised_host or self.host
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(metrics: SparrowMetrics, config: MetricsConfig | None = None) -> MetricsServer:
    """Serve `metrics` on the port its role binds (`MetricsConfig.for_role`: the coordinator from
    `port`, workers and ranks from `port + 1`), or exactly as `config` says."""
    config = config or metrics.config.for_role(metrics.role)
    ports = [0] if config.port == 0 else range(config.port, min(config.port + config.port_search, 65536))
    for port in ports:
        try:
            server, thread = start_http_server(port, addr=config.host, registry=metrics.registry)
        except OSError:
            continue
        return MetricsServer(config.host, server.server_port, server, thread, reachable_host(config.host))
    raise OSError(
        f"metrics: ports {config.port}..{config.port + config.port_search - 1} on {config.host} are all in use; "
        "set metrics.port to a free port (0 = any free port) or raise metrics.port_search"
    )
