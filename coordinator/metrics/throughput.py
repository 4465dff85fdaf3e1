"""Engine-busy time: tokens per busy second in windows (the `sparrow_rollout_tokens_per_second` gauge), each worker's
`EngineTime` report, and what a step reads from two of them (utilisation, batch shape)."""

from dataclasses import dataclass


@dataclass
class BusyRate:
    """Closes a window after `window_s` busy seconds, or early when the engine goes idle.

    Without the early close, a worker whose work comes in short bursts (a step's few groups taking less than
    `window_s` in all) would never report a rate: the gauge stayed empty on a fast machine.
    """

    window_s: float = 1.0
    tokens: int = 0
    busy_seconds: float = 0.0

    def update(self, tokens: int, busy_seconds: float, idle: bool) -> float | None:
        """The rate of the window that closes now, or None while it stays open (or nothing ran since the last)."""
        busy = busy_seconds - self.busy_seconds
        if busy <= 0 or (busy < self.window_s and not idle):
            return None
        rate = (tokens - self.tokens) / busy
        self.tokens, self.busy_seconds = tokens, busy_seconds
        return rate


@dataclass(frozen=True)
class EngineTime:
    """A worker's engine time, cumulative since it started: busy seconds and `BatchOccupancy.seconds`. It travels
    with every lease, renew and complete call to the dispatcher (one channel), which keeps the latest per worker;
    the step loop compares two readings."""

    busy_seconds: float = 0.0
    occupancy: tuple[float, ...] = ()


def busy_fractions(before: dict[str, float], now: dict[str, float], window_s: float) -> dict[str, float]:
    """Per worker: the fraction of `window_s` its engine was busy, from cumulative busy seconds then and now.

    A counter lower than before belongs to a replacement started under the same name (its count restarted
    from 0), so all of it fell in the window, as Prometheus reads a counter reset.
    """
    window = max(window_s, 1e-9)
    fractions = {}
    for worker in sorted(now):
        busy = now[worker] - before.get(worker, 0.0)
        fractions[worker] = min(1.0, (now[worker] if busy < 0 else busy) / window)
    return fractions


@dataclass
class BatchOccupancy:
    """Seconds an engine worked with b samples in flight (`seconds[b]`), summed since the worker started.

    Read from `EngineCounters.samples_running` on every turn of the worker's loop, so every backend has it. Its
    shape over a step says whether the rollout kept the engine's batch full or a few long samples decoded alone.
    """

    seconds: list[float]

    def __init__(self):
        self.seconds = []

    def add(self, running: int, seconds: float) -> None:
        if running < 0 or seconds < 0:
            raise ValueError(f"running={running}, seconds={seconds}: both must be >= 0")
        if running >= len(self.seconds):
            self.seconds.extend([0.0] * (running + 1 - len(self.seconds)))
        self.seconds[running] += seconds


@dataclass(frozen=True)
class BatchShape:
    """A step's rollout batch over time, pooled over the workers (only the time their engines had samples)."""

    busy_batch_fraction: float | None
    """Time-weighted samples in flight over `max_num_seqs`: 1.0 = every engine full all the time."""
    tail_share: float | None
    """Share of that time with fewer than half the step's peak batch in flight: the long tail."""
    peak: int
    """The most samples one engine had in flight during the step."""


def batch_shape(before: dict[str, list[float]], now: dict[str, list[float]], max_num_seqs: int) -> BatchShape:
    """The step's `BatchShape` from each worker's cumulative `BatchOccupancy.seconds` then and now.

    A worker whose seconds went down is a replacement under the same name (it counts from 0): all of its time
    fell in the step, as `busy_fractions` reads it.
    """
    pooled: list[float] = []
    for worker, seconds in now.items():
        old = before.get(worker, [])
        delta = [s - (old[b] if b < len(old) else 0.0) for b, s in enumerate(seconds)]
        if any(d < 0 for d in delta) or len(old) > len(seconds):
            delta = list(seconds)
        pooled.extend([0.0] * (len(delta) - len(pooled)))
        for b, d in enumerate(delta):
            pooled[b] += d
    working = [(b, s) for b, s in enumerate(pooled) if b > 0 and s > 0]
    total = sum(s for _, s in working)
    if not total:
        return BatchShape(None, None, 0)
    peak = max(b for b, _ in working)
    return BatchShape(
        busy_batch_fraction=sum(b * s for b, s in working) / (max_num_seqs * total),
        tail_share=sum(s for b, s in working if b < peak / 2) / total,
        peak=peak,
    )
