"""The closed-loop sparsity controller: a pure state machine from α histograms to schedules.

Each training step the coordinator feeds the trainers' dense-recompute α histograms (`observe`,
tagged with the schedule version the rollouts used) and asks for a decision (`decide`). Per length
bin, the evidence is the lower confidence bound of the tail percentile pooled over the last
window_steps steps, or the latest step's upper bound when that is lower (see tail.py):

- evidence < τ: a violation. Raise to the cheapest level the bin's α-vs-budget model predicts at
  ≥ τ + raise_margin, by at least 1, 2, 4, … levels on consecutive violations and at most
  max_raise_levels; at the max_violation_steps-th consecutive violation jump to the cheapest level
  measured safe, or dense. A violation at the largest sparse budget goes dense and retries that
  budget after dense_retry_steps (doubling after each failed retry).
- τ ≤ pooled bound < τ + lower_margin: hold (the hysteresis band).
- pooled bound ≥ τ + lower_margin for lower_patience judged steps, cooldown_steps after the last
  change, and the model predicts ≥ τ below: lower by up to max_lower_levels.

A bin is judged only with ≥ min_samples tokens measured at its current budget. Every bin gets a
`Decision` with its reason each step; the schedule's version is bumped only when a budget changes.
No I/O: the caller logs, publishes and persists (`state_dict`).
"""

from collections import OrderedDict, deque
from dataclasses import dataclass, field

import numpy as np

from sparrow.acceptance import AlphaHistogram
from sparrow.schedule import SparsitySchedule
from sparrow.tables import format_table

from .config import ControllerConfig
from .model import BinModel, Measurement, log2_blocks
from .tail import TailEstimate, tail_estimate

HISTORY_VERSIONS = 64
"""Schedule versions remembered to attribute late statistics to the budgets that produced them."""

REASONS = {
    "raise": "tail below τ: raised to the cheapest level predicted to reach τ + raise_margin",
    "raise_emergency": "below τ for max_violation_steps judged steps: jumped to a level measured safe, or dense",
    "dense_fallback": "below τ at the largest sparse budget (or for max_violation_steps): dense, retried later",
    "dense_retry": "dense retry interval elapsed: trying the largest sparse budget again",
    "lower": "headroom for lower_patience judged steps and the model predicts ≥ τ below: lowered",
    "monotone": "raised to keep budgets non-decreasing with length (monotone_in_length)",
    "hold_insufficient_samples": "fewer than min_samples tokens at the current budget",
    "hold_in_band": "τ ≤ tail < τ + lower_margin: inside the hysteresis band",
    "hold_headroom_pending": "headroom, but for fewer than lower_patience judged steps",
    "hold_cooldown": "headroom, but the bin changed less than cooldown_steps ago",
    "hold_model": "headroom, but the model predicts the level below would fall under τ",
    "hold_at_floor": "headroom at the ladder's cheapest level",
    "hold_dense_waiting": "dense after a fallback; waiting for the retry interval",
    "hold_dense_below_target": "dense and still below τ: the target is unreachable in this bin",
}


@dataclass(frozen=True)
class Decision:
    bin: int
    old: int | None  # top-k blocks before (None = dense)
    new: int | None  # top-k blocks after
    reason: str
    stats: dict = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return self.old != self.new

    def __str__(self) -> str:
        fmt = lambda v: "dense" if v is None else str(v)  # noqa: E731
        tail = ""
        if "alpha" in self.stats:
            tail = f" α={self.stats['alpha']:.4f} low={self.stats['alpha_low']:.4f} n={self.stats['count']}"
        return f"bin {self.bin}: {fmt(self.old)} -> {fmt(self.new)} ({self.reason}){tail}"


@dataclass
class ControlStep:
    step: int
    schedule: SparsitySchedule
    changed: bool
    decisions: list[Decision]
    notes: list[str]

    @property
    def changes(self) -> list[Decision]:
        return [d for d in self.decisions if d.changed]

    def table(self, all_bins: bool = False) -> str:
        """The step's changes (or every bin's decision) as a printable table."""
        fmt = lambda v: "dense" if v is None else v  # noqa: E731
        num = lambda d, k: f"{d.stats[k]:.4f}" if k in d.stats else "-"  # noqa: E731
        rows = [
            [d.bin, fmt(d.old), fmt(d.new), d.reason, d.stats.get("count", 0), num(d, "alpha"), num(d, "alpha_low")]
            for d in (self.decisions if all_bins else self.changes)
        ]
        return format_table(["bin", "old top-k", "new top-k", "reason", "tokens", "α tail", "α low"], rows)


@dataclass
class _Bin:
    level: int
    since: int = 0
    violations: int = 0
    headroom: int = 0
    fallback: bool = False
    retry_at: int = 0
    retry_interval: int = 0
    window: deque = field(default_factory=deque)  # (step, lower row, upper row or None)


def _sparse(row: np.ndarray | None) -> dict | None:
    if row is None:
        return None
    idx = np.flatnonzero(row)
    return {"idx": idx.tolist(), "val": row[idx].tolist(), "size": int(row.size)}


def _dense(d: dict | None) -> np.ndarray | None:
    if d is None:
        return None
    row = np.zeros(d["size"], dtype=np.int64)
    row[np.asarray(d["idx"], dtype=np.int64)] = d["val"]
    return row


class SparsityController:
    def __init__(self, config: ControllerConfig, initial: SparsitySchedule):
        self.config = config
        self.levels = config.levels()
        self.dense_level = len(self.levels)
        self.template = initial
        reserved = initial.sink + initial.recent
        # A level whose budget covers a bin's longest sequence attends to everything there: it is
        # dense in all but name, so the model treats it like dense and lowering skips past it.
        self.saturation = []
        for b in range(initial.num_bins):
            hi = initial.bin_range(b)[1]
            cap = None if hi is None else -(-hi // initial.block_size)
            self.saturation.append(
                next((lvl for lvl, v in enumerate(self.levels) if cap is not None and v + reserved >= cap), len(self.levels))
            )
        self._x = [
            {lvl: log2_blocks(v, reserved) for lvl, v in enumerate(self.levels) if lvl < self.saturation[b]}
            for b in range(initial.num_bins)
        ]
        self.step = 0
        self._resolution: int | None = None
        self._notes: list[str] = []
        levels = [self._snap(b, v) for b, v in enumerate(initial.topk_blocks)]
        self.bins = [_Bin(level=lvl) for lvl in levels]
        self.models = [BinModel(config.prior_slope) for _ in levels]
        topk = [self.topk_of(lvl) for lvl in levels]
        self.schedule = initial if tuple(topk) == initial.topk_blocks else initial.with_topk(topk)
        self._history: OrderedDict[int, tuple[int, ...]] = OrderedDict({self.schedule.version: tuple(levels)})

    @property
    def num_bins(self) -> int:
        return len(self.bins)

    def effective_level(self, b: int, level: int) -> int:
        """`level`, or the dense level when its budget covers bin b's longest sequence (`saturation[b]`)."""
        return self.dense_level if level >= self.saturation[b] else level

    def topk_of(self, level: int) -> int | None:
        return None if level == self.dense_level else self.levels[level]

    def _snap(self, b: int, topk: int | None) -> int:
        """Ladder level of a warm-start value: the cheapest level at least as large (safe side)."""
        if topk is None:
            return self.dense_level
        level = next((i for i, v in enumerate(self.levels) if v >= topk), self.dense_level)
        if self.topk_of(level) != topk:
            self._notes.append(f"bin {b}: warm-start top-k {topk} is not on the ladder; using {self.topk_of(level) or 'dense'}")
        return level

    # inputs -----------------------------------------------------------------------------------
    def observe(self, alpha: AlphaHistogram, schedule_version: int, alpha_upper: AlphaHistogram | None = None) -> None:
        """Add one trainer report: α histogram (lower bound, or exact) of rollouts made with `schedule_version`."""
        if alpha.num_length_bins != self.num_bins:
            raise ValueError(
                f"alpha has {alpha.num_length_bins} length bins but the schedule has {self.num_bins}; "
                "histogram with the schedule's bins (schedule.bin_of)"
            )
        if self._resolution is None:
            self._resolution = alpha.resolution
        if alpha.resolution != self._resolution:
            raise ValueError(
                f"alpha has resolution {alpha.resolution} but earlier reports had {self._resolution}; "
                "build every AlphaHistogram with the same resolution"
            )
        if alpha_upper is not None and alpha_upper.counts.shape != alpha.counts.shape:
            raise ValueError(f"alpha_upper shape {tuple(alpha_upper.counts.shape)} differs from alpha {tuple(alpha.counts.shape)}")
        levels_then = self._history.get(schedule_version)
        if levels_then is None:
            self._notes.append(
                f"ignored α of schedule version {schedule_version}: not among the last {len(self._history)} versions"
            )
            return
        cfg = self.config
        counts = alpha.counts.numpy()
        upper_counts = None if alpha_upper is None else alpha_upper.counts.numpy()
        for b, n in enumerate(counts.sum(1).tolist()):
            if n == 0:
                continue
            lower = counts[b].copy()
            upper = None if upper_counts is None else upper_counts[b].copy()
            st = self.bins[b]
            if levels_then[b] == st.level:
                if st.window and st.window[-1][0] == self.step:
                    _, lo, up = st.window.pop()
                    lower, upper = lo + lower, None if up is None or upper is None else up + upper
                st.window.append((self.step, lower, upper))
            elif n >= cfg.min_samples:  # late data from another budget still teaches the model
                est = tail_estimate(lower, upper, cfg.percentile, cfg.confidence_z, cfg.statistic)
                self.models[b].record(Measurement(levels_then[b], est.low, est.count, self.step))

    # decision ---------------------------------------------------------------------------------
    def decide(self) -> ControlStep:
        cfg = self.config
        old_levels = [st.level for st in self.bins]
        decisions = [self._decide_bin(b, st) for b, st in enumerate(self.bins)]
        if cfg.monotone_in_length:
            for b in range(1, self.num_bins):
                floor = self.bins[b - 1].level
                if self.bins[b].level < floor:
                    prior = decisions[b]
                    self._change(self.bins[b], floor)
                    stats = dict(prior.stats, overridden_reason=prior.reason)
                    decisions[b] = Decision(b, self.topk_of(old_levels[b]), self.topk_of(floor), "monotone", stats)
        levels = tuple(st.level for st in self.bins)
        changed = list(levels) != old_levels
        if changed:
            self.schedule = self.schedule.with_topk([self.topk_of(lvl) for lvl in levels])
            self._history[self.schedule.version] = levels
            while len(self._history) > HISTORY_VERSIONS:
                self._history.popitem(last=False)
        for b, st in enumerate(self.bins):
            self.models[b].forget_before(self.step - cfg.model_memory_steps, keep_level=st.level)
        notes, self._notes = self._notes, []
        result = ControlStep(self.step, self.schedule, changed, decisions, notes)
        self.step += 1
        return result

    def step_with(self, alpha: AlphaHistogram, schedule_version: int, alpha_upper: AlphaHistogram | None = None) -> ControlStep:
        """`observe` one merged histogram, then `decide`."""
        self.observe(alpha, schedule_version, alpha_upper)
        return self.decide()

    def _estimates(self, st: _Bin) -> tuple[TailEstimate | None, TailEstimate | None]:
        """(pooled over the window, latest step alone): headroom is judged on the pooled estimate,
        violations on whichever is lower, so a sudden drop is not diluted by older steps."""
        cfg = self.config
        while st.window and st.window[0][0] <= self.step - cfg.window_steps:
            st.window.popleft()
        if not st.window:
            return None, None
        lower = sum(w[1] for w in st.window)
        uppers = [w[2] for w in st.window]
        upper = None if any(u is None for u in uppers) else sum(uppers)
        pooled = tail_estimate(lower, upper, cfg.percentile, cfg.confidence_z, cfg.statistic)
        step, lower, upper = st.window[-1]
        latest = None
        if len(st.window) > 1 and step == self.step and lower.sum() >= cfg.min_samples:
            latest = tail_estimate(lower, upper, cfg.percentile, cfg.confidence_z, cfg.statistic)
        return pooled, latest

    def _change(self, st: _Bin, level: int) -> None:
        st.level, st.since, st.headroom = level, self.step, 0
        st.window.clear()

    def _decide_bin(self, b: int, st: _Bin) -> Decision:
        cfg, tau = self.config, self.config.target
        old = self.topk_of(st.level)
        est, latest = self._estimates(st)
        stats = {"target": tau, **({} if est is None else est.to_dict())}
        if latest is not None:
            stats["alpha_latest"], stats["alpha_latest_high"] = latest.value, latest.high

        def hold(reason: str) -> Decision:
            return Decision(b, old, old, reason, dict(stats, violations=st.violations, headroom=st.headroom))

        def move(level: int, reason: str) -> Decision:
            self._change(st, level)
            return Decision(b, old, self.topk_of(level), reason, dict(stats, violations=st.violations))

        if est is None or est.count < cfg.min_samples:
            return hold("hold_insufficient_samples")
        # The pooled lower bound, or the latest step's upper bound when even that is lower: a sudden
        # drop shows in one step, a persistent small deficit in the pooled bound.
        evidence = est.low if latest is None else min(est.low, latest.high)
        self.models[b].record(Measurement(st.level, evidence, est.count, self.step))

        if evidence < tau:
            st.headroom = 0
            if st.level == self.dense_level:
                return hold("hold_dense_below_target")
            st.violations += 1
            return self._raise(b, st, move)
        st.violations = 0
        if st.level == self.dense_level and st.fallback:
            if self.step < st.retry_at:
                return hold("hold_dense_waiting")
            st.fallback = False
            if self.saturation[b] == 0:
                return hold("hold_at_floor")
            return move(self.saturation[b] - 1, "dense_retry")
        if est.low < tau + cfg.lower_margin:
            st.headroom = 0
            return hold("hold_in_band")
        st.headroom += 1
        if st.headroom < cfg.lower_patience:
            return hold("hold_headroom_pending")
        if self.step - st.since < cfg.cooldown_steps:
            return hold("hold_cooldown")
        top = min(st.level, self.saturation[b])
        if top == 0:
            return hold("hold_at_floor")
        target = None
        for level in range(top - 1, max(top - cfg.max_lower_levels, 0) - 1, -1):
            predicted = self.models[b].predict(level, self._x[b])
            stats[f"predicted_{self.topk_of(level)}"] = predicted
            if predicted is not None and predicted < tau:
                break
            target = level
        if target is None:
            return hold("hold_model")
        if target < self.saturation[b] - 1:
            st.retry_interval = 0  # sparse again below the ladder's top: a later fallback starts afresh
        return move(target, "lower")

    def _raise(self, b: int, st: _Bin, move) -> Decision:
        cfg, tau, model = self.config, self.config.target, self.models[b]
        top = self.saturation[b] - 1  # the largest budget that is still sparse in this bin
        if st.level >= top:
            return self._fallback(st, move)
        if st.violations >= cfg.max_violation_steps:
            safe = next(
                (lvl for lvl in range(st.level + 1, top + 1)
                 if lvl in model.measurements and model.measurements[lvl].alpha >= tau),
                None,
            )
            return self._fallback(st, move) if safe is None else move(safe, "raise_emergency")
        want = next(
            (lvl for lvl in range(st.level + 1, top + 1)
             if (p := model.predict(lvl, self._x[b])) is not None and p >= tau + cfg.raise_margin),
            top,
        )
        min_jump = min(2 ** (st.violations - 1), cfg.max_raise_levels)
        return move(min(max(want, st.level + min_jump), st.level + cfg.max_raise_levels, top), "raise")

    def _fallback(self, st: _Bin, move) -> Decision:
        cfg = self.config
        st.retry_interval = (
            cfg.dense_retry_steps if st.retry_interval == 0 else min(2 * st.retry_interval, cfg.max_dense_retry_steps)
        )
        st.retry_at, st.fallback = self.step + st.retry_interval, True
        return move(self.dense_level, "dense_fallback")

    # persistence ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """JSON-serialisable state for --resume."""
        return {
            "format": 1,
            "step": self.step,
            "resolution": self._resolution,
            "levels": list(self.levels),
            "schedule": self.schedule.to_dict(),
            "history": {str(v): list(lv) for v, lv in self._history.items()},
            "bins": [
                {
                    "level": st.level, "since": st.since, "violations": st.violations, "headroom": st.headroom,
                    "fallback": st.fallback, "retry_at": st.retry_at, "retry_interval": st.retry_interval,
                    "window": [[s, _sparse(lo), _sparse(up)] for s, lo, up in st.window],
                }
                for st in self.bins
            ],
            "models": [m.state_dict() for m in self.models],
        }

    @classmethod
    def from_state_dict(cls, config: ControllerConfig, state: dict) -> "SparsityController":
        if state.get("format") != 1:
            raise ValueError(f"controller state format {state.get('format')!r} is not supported (expected 1)")
        if tuple(state["levels"]) != config.levels():
            raise ValueError(
                f"controller state was saved with ladder {state['levels']} but the config's ladder is "
                f"{list(config.levels())}; resume with the same ladder or start afresh"
            )
        schedule = SparsitySchedule.from_dict(state["schedule"], origin="controller state")
        ctl = cls(config, schedule)
        ctl.step, ctl._resolution = state["step"], state["resolution"]
        ctl._history = OrderedDict((int(v), tuple(lv)) for v, lv in state["history"].items())
        for st, d in zip(ctl.bins, state["bins"]):
            st.level, st.since, st.violations, st.headroom = d["level"], d["since"], d["violations"], d["headroom"]
            st.fallback, st.retry_at, st.retry_interval = d["fallback"], d["retry_at"], d["retry_interval"]
            st.window = deque((s, _dense(lo), _dense(up)) for s, lo, up in d["window"])
        for model, d in zip(ctl.models, state["models"]):
            model.load_state_dict(d)
        ctl._notes = []
        return ctl
