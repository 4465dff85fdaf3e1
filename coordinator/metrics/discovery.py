"""Scrape targets of a run as a Prometheus `file_sd` file (docs/metrics.md, "Finding the processes").

The coordinator keeps `RUN_DIR/prometheus_targets.json` listing the `/metrics` endpoint of every
process of the run, each labelled `role` (coordinator, rollout, trainer), `worker` (coordinator,
rollout-N, trainer-N) and `run` (the run directory's name), and replaces the file atomically whenever
a process comes or goes; Prometheus (`file_sd_configs`, deploy/prometheus.yml) follows it within
seconds. When the run ends the file is emptied, so Prometheus stops scraping processes that are gone.

    targets = ScrapeTargets.for_run(run_dir, config.metrics)
    targets.set("coordinator", "coordinator", metrics_server.url)
    targets.set("rollout-0", "rollout", worker_metrics_url)     # a worker joined (or moved)
    targets.remove("rollout-0")                                  # ... and left
    targets.clear()                                              # the run is over
"""

import json
import os
import re
import tempfile
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from urllib.parse import urlsplit

from .config import MetricsConfig

TARGETS_FILE = "prometheus_targets.json"
ROLE_NAMES = ("coordinator", "rollout", "trainer")
_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")


def target_labels(role: str, worker: str, run: str) -> dict[str, str]:
    """The labels Sparrow gives a scrape target."""
    if role not in ROLE_NAMES:
        raise ValueError(f"role={role!r}: one of {', '.join(ROLE_NAMES)}")
    return {"role": role, "worker": worker, "run": run}


def file_sd_groups(targets: Iterable[tuple[str, Mapping[str, str]]]) -> list[dict]:
    """The content of a Prometheus file_sd file for `(url, labels)` pairs: one target group per URL
    (`host:port`; a path other than /metrics goes in `__metrics_path__`, https in `__scheme__`),
    sorted by address so the same membership always gives the same file. Pure."""
    groups, seen = [], set()
    for url, labels in targets:
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in ("http", "https") or not parts.hostname or port is None:
            raise ValueError(f"{url!r}: a scrape target is http(s)://host:port/path")
        group_labels = {str(k): str(v) for k, v in labels.items()}
        bad = [k for k in group_labels if not _LABEL.match(k) or k.startswith("__")]
        if bad:
            raise ValueError(f"{url!r}: label names {bad} are not valid Prometheus label names (or are reserved)")
        if parts.path not in ("", "/metrics"):
            group_labels["__metrics_path__"] = parts.path
        if parts.scheme == "https":
            group_labels["__scheme__"] = "https"
        if parts.netloc in seen:
            raise ValueError(f"{parts.netloc} is listed twice")
        seen.add(parts.netloc)
        groups.append({"targets": [parts.netloc], "labels": group_labels})
    return sorted(groups, key=lambda g: g["targets"][0])


def write_file_sd(path: str | Path, targets: Iterable[tuple[str, Mapping[str, str]]]) -> Path:
    """Write `file_sd_groups(targets)` to `path` atomically (a temporary file in the same directory,
    then rename): Prometheus never reads a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(file_sd_groups(targets), indent=2) + "\n"
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it 0600; a Prometheus under its own user must read it
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


class ScrapeTargets:
    """The run's processes by worker id; every change rewrites the file(s) at once. Thread-safe."""

    def __init__(self, paths: Iterable[str | Path], run: str):
        self.paths = [Path(p) for p in paths]
        self.run = run
        self.targets: dict[str, tuple[str, str]] = {}  # worker → (role, url)
        self._lock = threading.Lock()

    @classmethod
    def for_run(cls, run_dir, config: MetricsConfig | None = None) -> "ScrapeTargets":
        """`RUN_DIR/prometheus_targets.json`, and `<metrics.file_sd_dir>/<run>.json` when that is set;
        `run` is the run directory's name. Writes the (empty) file(s) at once."""
        path = Path(getattr(run_dir, "path", run_dir))
        paths = [path / TARGETS_FILE]
        if config is not None and config.file_sd_dir:
            paths.append(Path(config.file_sd_dir) / f"{path.name}.json")
        targets = cls(paths, path.name)
        targets.write()
        return targets

    def set(self, worker: str, role: str, url: str | None) -> None:
        """Add or move a process; `url` None (its metrics are off) removes it."""
        with self._lock:
            if url is None:
                self.targets.pop(worker, None)
            else:
                target_labels(role, worker, self.run)  # validates the role
                self.targets[worker] = (role, url)
            self._write()

    def remove(self, worker: str) -> None:
        with self._lock:
            if self.targets.pop(worker, None) is not None:
                self._write()

    def clear(self) -> None:
        with self._lock:
            self.targets.clear()
            self._write()

    def write(self) -> None:
        with self._lock:
            self._write()

    def content(self) -> list[dict]:
        with self._lock:
            return file_sd_groups(self._pairs())

    def _pairs(self) -> list[tuple[str, dict[str, str]]]:
        return [(url, target_labels(role, worker, self.run)) for worker, (role, url) in self.targets.items()]

    def _write(self) -> None:
        pairs = self._pairs()
        for path in self.paths:
            write_file_sd(path, pairs)
