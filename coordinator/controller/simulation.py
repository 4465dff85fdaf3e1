"""A pure simulation of the α response to the KV budget, for tests and the convergence plot.

A response gives, per length bin and budget, the population tail (the `percentile`-th percentile of
α). Token α values are drawn so that this percentile holds exactly: α = 1 − (1 − tail)·Y / y*, with
Y ~ Beta(a, b) and y* its (100 − percentile)-th percentile, a shape with most tokens near α = 1 and
a long tail, as measured in Sparrow (a Beta fits the tail with KS < 0.04). Finite token counts per
bin and step give the sampling noise the controller must live with.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from sparrow.acceptance import AlphaHistogram
from sparrow.schedule import SparsitySchedule

from .controller import ControlStep, Decision, SparsityController


def _bin_length(schedule: SparsitySchedule, b: int) -> float:
    lo, hi = schedule.bin_range(b)
    return (lo + hi) / 2 if hi is not None else lo + 1000.0


@dataclass(frozen=True)
class PowerLawResponse:
    """tail = 1 − d0·(L/2000)^γ·(B/512)^−β, floored at the dense noise floor 1 − dense_deficit.

    L is the bin's mid length, B the budget in tokens. The defaults reproduce the qwen3-1.7b tables
    roughly: τ = 0.86 needs 512 tokens at 1K and 4K at 19K.
    """

    d0: float = 0.178
    length_exponent: float = 0.35
    budget_exponent: float = 0.5
    dense_deficit: float = 0.02

    def tail(self, schedule: SparsitySchedule, b: int, topk: int | None) -> float:
        length = _bin_length(schedule, b)
        if topk is None or math.ceil(length / schedule.block_size) <= topk + schedule.sink + schedule.recent:
            return 1.0 - self.dense_deficit
        budget = (topk + schedule.sink + schedule.recent) * schedule.block_size
        deficit = self.d0 * (length / 2000) ** self.length_exponent * (budget / 512) ** -self.budget_exponent
        return 1.0 - min(max(deficit, self.dense_deficit), 1.0)


@dataclass(frozen=True)
class TableResponse:
    """Explicit tails: `tails[b][i]` at top-k `ladder[i]`, `dense[b]` when dense."""

    ladder: tuple[int, ...]
    tails: tuple[tuple[float, ...], ...]
    dense: tuple[float, ...]

    def tail(self, schedule: SparsitySchedule, b: int, topk: int | None) -> float:
        return self.dense[b] if topk is None else self.tails[b][self.ladder.index(topk)]


def beta_quantile(a: float, b: float, q: float, grid: int = 200_001) -> float:
    """Quantile of Beta(a, b) by quadrature after x = t^(1/a), which removes the x^(a−1) singularity."""
    t = np.linspace(0.0, 1.0, grid)
    density = np.clip(1.0 - t ** (1.0 / a), 0.0, None) ** (b - 1.0)
    cdf = np.concatenate([[0.0], np.cumsum((density[1:] + density[:-1]) / 2)])
    cdf /= cdf[-1]
    return float(np.interp(q, cdf, t) ** (1.0 / a))


@dataclass
class Simulator:
    response: PowerLawResponse | TableResponse
    tokens_per_bin: int | Sequence[int] = 5000
    seed: int = 0
    resolution: int = 2000
    percentile: float = 5.0
    beta: tuple[float, float] = (0.5, 4.0)
    upper_gap: float | None = None
    """When set, also return an upper-bound histogram with α_upper = α + upper_gap·(1 − α)."""

    def __post_init__(self):
        self._rng = np.random.default_rng(self.seed)
        self._y_star = beta_quantile(*self.beta, 1.0 - self.percentile / 100.0)

    def true_tails(self, schedule: SparsitySchedule) -> np.ndarray:
        return np.array([self.response.tail(schedule, b, v) for b, v in enumerate(schedule.topk_blocks)])

    def _tokens(self, b: int) -> int:
        return self.tokens_per_bin if isinstance(self.tokens_per_bin, int) else self.tokens_per_bin[b]

    def measure(self, schedule: SparsitySchedule) -> tuple[AlphaHistogram, AlphaHistogram | None]:
        """One step of dense-recompute statistics for rollouts made with `schedule`."""
        res, bins = self.resolution, schedule.num_bins
        lower, lower_sums = np.zeros((bins, res), dtype=np.int64), np.zeros(bins)
        upper, upper_sums = np.zeros((bins, res), dtype=np.int64), np.zeros(bins)
        for b, tail in enumerate(self.true_tails(schedule)):
            n = self._tokens(b)
            if n == 0:
                continue
            y = self._rng.beta(*self.beta, size=n)
            alpha = np.clip(1.0 - (1.0 - tail) * y / self._y_star, 0.0, 1.0)
            # Same cells as AlphaHistogram.add: [j/R, (j+1)/R), α = 1 in the last.
            lower[b] = np.bincount(np.minimum((alpha * res).astype(np.int64), res - 1), minlength=res)
            lower_sums[b] = alpha.sum()
            if self.upper_gap is not None:
                up = alpha + self.upper_gap * (1.0 - alpha)
                upper[b] = np.bincount(np.minimum((up * res).astype(np.int64), res - 1), minlength=res)
                upper_sums[b] = up.sum()
        hist = lambda c, s: AlphaHistogram(torch.from_numpy(c), torch.from_numpy(s))  # noqa: E731
        return hist(lower, lower_sums), hist(upper, upper_sums) if self.upper_gap is not None else None


def cheapest_levels(controller: SparsityController, response, target: float) -> list[int]:
    """Per bin, the cheapest ladder level whose true tail reaches `target`; the dense level if none
    does or if the first that does already covers the bin's longest sequence (dense in effect)."""
    template = controller.schedule
    out = []
    for b in range(controller.num_bins):
        level = next(
            (lvl for lvl in range(controller.dense_level) if response.tail(template, b, controller.topk_of(lvl)) >= target),
            controller.dense_level,
        )
        out.append(controller.effective_level(b, level))
    return out


@dataclass
class Trace:
    """What a simulated run did, step by step (rows: steps, columns: length bins)."""

    levels: np.ndarray  # ladder level used for the step's rollouts
    topk: list[tuple[int | None, ...]]
    true_tail: np.ndarray  # the response's tail at that level
    measured: np.ndarray  # the controller's point estimate (NaN when not judged)
    decisions: list[list[Decision]] = field(default_factory=list)

    def violation_runs(self, target: float, tolerance: float = 0.0) -> np.ndarray:
        """Per bin, the longest run of consecutive steps with true tail < target − tolerance."""
        below = self.true_tail < target - tolerance
        longest = np.zeros(below.shape[1], dtype=int)
        run = np.zeros(below.shape[1], dtype=int)
        for row in below:
            run = np.where(row, run + 1, 0)
            longest = np.maximum(longest, run)
        return longest

    def changes(self, start: int = 0) -> np.ndarray:
        """Per bin, how often its budget changed from step `start` on."""
        lv = self.levels[start:]
        return (lv[1:] != lv[:-1]).sum(0)


def simulate(controller: SparsityController, simulator: Simulator, steps: int) -> Trace:
    levels, topk, tails, measured, decisions = [], [], [], [], []
    for _ in range(steps):
        schedule = controller.schedule
        levels.append([st.level for st in controller.bins])
        topk.append(schedule.topk_blocks)
        tails.append(simulator.true_tails(schedule))
        lower, upper = simulator.measure(schedule)
        result: ControlStep = controller.step_with(lower, schedule.version, upper)
        measured.append([d.stats.get("alpha", math.nan) for d in result.decisions])
        decisions.append(result.decisions)
    return Trace(np.array(levels), topk, np.array(tails), np.array(measured), decisions)
