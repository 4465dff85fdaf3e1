"""Prometheus metrics of the coordinator, rollout workers and trainers (docs/metrics.md)."""

from .config import DEFAULT_ALPHA_BUCKETS, MetricsConfig
from .registry import SparrowMetrics
from .server import MetricsServer, start_metrics_server

__all__ = ["DEFAULT_ALPHA_BUCKETS", "MetricsConfig", "MetricsServer", "SparrowMetrics", "start_metrics_server"]
