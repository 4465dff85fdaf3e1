"""A bin's local model of tail α versus budget, from the budgets it has measured recently.

α is modelled as piecewise linear in log2(total blocks): measured levels are fitted isotonically
(α never falls when the budget grows), unmeasured levels between two measured ones are interpolated,
and levels outside the measured range are extrapolated with the slope of the two nearest measured
levels (shrunk towards the prior slope when they are less than a doubling apart, and clamped to
[prior/4, 2·prior]) or, with one measurement, the prior slope.
"""

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Measurement:
    level: int
    alpha: float  # lower confidence bound of the tail at that level
    count: int
    step: int


def _isotonic(points: list[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """Pool-adjacent-violators on (x, y, weight) sorted by x → non-decreasing (x, y)."""
    blocks: list[list[float]] = []  # [weighted y sum, weight, first index, last index]
    for i, (_, y, w) in enumerate(points):
        blocks.append([y * w, w, i, i])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, w2, _, last = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += w2
            blocks[-1][3] = last
    fitted = [0.0] * len(points)
    for s, w, first, last in blocks:
        for i in range(first, last + 1):
            fitted[i] = s / w
    return [(points[i][0], fitted[i]) for i in range(len(points))]


class BinModel:
    def __init__(self, prior_slope: float):
        self.prior_slope = prior_slope
        self.measurements: dict[int, Measurement] = {}

    def record(self, m: Measurement) -> None:
        self.measurements[m.level] = m

    def forget_before(self, step: int, keep_level: int) -> None:
        self.measurements = {
            lvl: m for lvl, m in self.measurements.items() if m.step >= step or lvl == keep_level
        }

    def predict(self, level: int, x_of: dict[int, float]) -> float | None:
        """Predicted tail α at `level` (x_of maps sparse levels to log2 total blocks); None if unknown."""
        sparse = sorted((m for m in self.measurements.values() if m.level in x_of), key=lambda m: x_of[m.level])
        if level not in x_of:  # dense: only a measurement tells
            m = self.measurements.get(level)
            return None if m is None else m.alpha
        if not sparse:
            return None
        fit = _isotonic([(x_of[m.level], m.alpha, float(m.count)) for m in sparse])
        x = x_of[level]
        for (x0, y0), (x1, y1) in zip(fit, fit[1:]):
            if x0 <= x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y0
        if x < fit[0][0]:
            return max(0.0, fit[0][1] - self._slope(fit[:2]) * (fit[0][0] - x))
        return min(1.0, fit[-1][1] + self._slope(fit[-2:]) * (x - fit[-1][0]))

    def _slope(self, pair: list[tuple[float, float]]) -> float:
        """Slope through two fitted points, shrunk towards the prior when they are less than one
        doubling apart (a short baseline turns noise into slope), clamped to [prior/4, 2·prior]."""
        if len(pair) < 2:
            return self.prior_slope
        (x0, y0), (x1, y1) = pair
        fitted = min(max((y1 - y0) / (x1 - x0), self.prior_slope / 4), 2 * self.prior_slope)
        weight = min(1.0, x1 - x0)
        return weight * fitted + (1 - weight) * self.prior_slope

    def state_dict(self) -> list[dict]:
        return [asdict(m) for m in self.measurements.values()]

    def load_state_dict(self, state: list[dict]) -> None:
        self.measurements = {d["level"]: Measurement(**d) for d in state}


def log2_blocks(topk: int, reserved: int) -> float:
    return math.log2(max(topk + reserved, 1))
