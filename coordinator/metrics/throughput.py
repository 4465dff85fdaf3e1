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
