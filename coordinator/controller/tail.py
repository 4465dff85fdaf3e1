"""The tail statistic of one length bin, with a distribution-free confidence band.

With n tokens the rank of the p-quantile is ~Binomial(n, p), so the α values at ranks
n·p ∓ z·sqrt(n·p·(1−p)) bracket the true percentile; `low` is what the controller compares with τ.
A bin judged on few tokens therefore needs more headroom, and one judged on many tokens less.
"""

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TailEstimate:
    count: int
    value: float  # point estimate of the percentile
    low: float  # lower confidence bound
    high: float  # upper confidence bound

    def to_dict(self) -> dict:
        return {"count": self.count, "alpha": self.value, "alpha_low": self.low, "alpha_high": self.high}


def row_percentiles(row: np.ndarray, fractions: np.ndarray) -> np.ndarray:
    """Percentiles (as fractions in [0, 1]) of one histogram row of α cells, interpolated inside a
    cell exactly as `AlphaHistogram.percentile` does."""
    res = row.shape[0]
    cum = np.cumsum(row)
    rank = np.clip(fractions, 0.0, 1.0) * cum[-1]
    cell = np.minimum(np.searchsorted(cum, np.maximum(rank, 1.0)), res - 1)
    below = np.where(cell > 0, cum[np.maximum(cell - 1, 0)], 0)
    frac = np.clip((rank - below) / np.maximum(row[cell], 1), 0.0, 1.0)
    return (cell + frac) / res


def _estimate(row: np.ndarray, pct: float, z: float) -> TailEstimate:
    n = int(row.sum())
    p = pct / 100.0
    spread = z * math.sqrt(p * (1 - p) / n)
    value, low, high = row_percentiles(row, np.array([p, p - spread, p + spread]))
    return TailEstimate(n, float(value), float(low), float(high))


def tail_estimate(
    lower: np.ndarray, upper: np.ndarray | None, pct: float, z: float, statistic: str
) -> TailEstimate | None:
    """From one bin's histogram row(s) of the α lower bound (and upper bound, when the trainer has
    both): the percentile under `statistic` ("lower", "upper" or "midpoint"; "exact" reads `lower`, which then
    holds exact α); None for no tokens."""
    if int(lower.sum()) == 0:
        return None
    if statistic in ("lower", "exact") or upper is None:
        return _estimate(lower, pct, z)
    hi = _estimate(upper, pct, z)
    if statistic == "upper":
        return hi
    lo = _estimate(lower, pct, z)
    return TailEstimate(lo.count, (lo.value + hi.value) / 2, (lo.low + hi.low) / 2, (lo.high + hi.high) / 2)
