"""Prometheus metrics of the coordinator, rollout workers and trainers (docs/metrics.md)."""

from .config import DEFAULT_ALPHA_BUCKETS, MetricsConfig
from .discovery import TARGETS_FILE, ScrapeTargets, file_sd_groups, target_labels, write_file_sd
from .registry import ROLE_FAMILIES, ROLES, SparrowMetrics
from .server import MetricsServer, start_metrics_server
from .throughput import BatchOccupancy, BatchShape, BusyRate, EngineTime, batch_shape, busy_fractions

__all__ = [
    "BatchOccupancy", "BatchShape", "BusyRate", "DEFAULT_ALPHA_BUCKETS", "EngineTime", "MetricsConfig", "MetricsServer", "ROLES", "ROLE_FAMILIES", "ScrapeTargets",
    "SparrowMetrics", "TARGETS_FILE", "batch_shape", "busy_fractions", "file_sd_groups", "start_metrics_server", "target_labels",
    "write_file_sd",
]
