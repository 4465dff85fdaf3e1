"""Watching a `sparrow train` job from outside, for the chaos soak (`chaos_soak.py`): which process is a given
worker (from the run's scrape targets and the process listening on that /metrics port), and, while it runs, its
output, its new events and step records and scrapes of the coordinator's /metrics, each with the time it was
first seen."""

import json
import os
import subprocess
import threading
import time
import urllib.request
from collections import deque
from pathlib import Path

from sparrow.bench.chaos_audit import TRAIN_STEP, parse_metrics

ACTOR_TITLES = {"rollout": "ray::RolloutWorker", "trainer": "ray::TrainerHost"}
"""What Ray titles the process of each actor (its command line starts with it)."""


def listening_pid(port: int) -> int | None:
    """The process with a listening TCP socket on `port` (Linux /proc: the socket's inode, then whose fd it is)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{fields[9]}]")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                return int(pid)
        except OSError:  # gone, or not ours
            continue
    return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def scrape_targets(run_dir: Path) -> dict[str, tuple[str, str]]:
    """worker id -> (role, host:port) from RUN_DIR/prometheus_targets.json ({} while it does not exist yet)."""
    try:
        groups = json.loads((run_dir / "prometheus_targets.json").read_text())
    except (OSError, ValueError):
        return {}
    return {g["labels"]["worker"]: (g["labels"]["role"], g["targets"][0]) for g in groups}


def worker_pid(run_dir: Path, worker: str) -> int | None:
    """The pid of `worker`'s process, checked to be that kind of Ray actor."""
    role, address = scrape_targets(run_dir).get(worker, (None, None))
    if address is None:
        return None
    pid = listening_pid(int(address.rsplit(":", 1)[1]))
    return pid if pid is not None and _cmdline(pid).startswith(ACTOR_TITLES[role]) else None


class Watch:
    """The job's output (timestamped to OUT/train.log) and, every `scrape_s`, its new events and step records and
    a scrape of the coordinator's /metrics. Times are seconds since `t0`, the job's first step (until then:
    since the soak started)."""

    def __init__(self, proc: subprocess.Popen, run_dir: Path, log_path: Path, scrape_s: float):
        self.proc, self.run_dir, self.scrape_s = proc, run_dir, scrape_s
        self.t0 = time.monotonic()
        self.started = False
        self.scraping = True
        self.tail: deque[str] = deque(maxlen=60)
        self.events: list[tuple[float, dict]] = []
        self.records: list[tuple[float, dict]] = []
        """Step records (metrics.jsonl lines) in the order they appeared; a redone step appears again."""
        self.scrapes: list[tuple[float, dict | None]] = []
        self._seen_records: set[str] = set()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._read_output, args=(log_path,), daemon=True),
                         threading.Thread(target=self._poll, daemon=True)]
        for t in self._threads:
            t.start()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def _read_output(self, log_path: Path) -> None:
        with log_path.open("w") as log:
            for line in self.proc.stdout:
                self.tail.append(line.rstrip())
                log.write(f"[{self.now():8.1f} s] {line}")
                log.flush()

    def _poll(self) -> None:
        while self.proc.poll() is None:
            self._read_files()
            if self.started and self.scraping:
                self._scrape()
            time.sleep(self.scrape_s)

    def _read_files(self) -> None:
        events = lines(self.run_dir / "events.jsonl")
        records = [t for t in lines(self.run_dir / "metrics.jsonl") if t not in self._seen_records]
        with self._lock:
            if records and not self.started:
                self.t0, self.started = time.monotonic(), True
            t = self.now()
            self.events += [(t, json.loads(e)) for e in events[len(self.events):]]
            self.records += [(t, json.loads(r)) for r in records]
            self._seen_records.update(records)

    def _scrape(self) -> None:
        address = scrape_targets(self.run_dir).get("coordinator", (None, None))[1]
        try:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
                sample = parse_metrics(reply.read().decode())
        except (OSError, ValueError):
            sample = None
        with self._lock:
            self.scrapes.append((self.now(), sample))

    def train_step(self) -> int | None:
        """Steps completed, as the coordinator's last answered scrape says."""
        with self._lock:
            value = next((s.get((TRAIN_STEP, ())) for _, s in reversed(self.scrapes) if s), None)
        return None if value is None else int(value)

    def snapshot(self) -> tuple[list, list]:
        with self._lock:
            return list(self.events), list(self.records)

    def finish(self) -> None:
        for t in self._threads:
            t.join(timeout=30)
        self._read_files()


def lines(path: Path) -> list[str]:
    """The complete lines of a JSONL file the job appends to (a line still being written is left for later)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    return [line for line in text[: text.rfind("\n") + 1].splitlines() if line.strip()]
