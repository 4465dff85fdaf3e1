"""Tokens per engine-busy second, reported in windows: the `sparrow_rollout_tokens_per_second` gauge's arithmetic."""

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
