"""The cheapest schedule whose measured tail acceptance meets a target in every length bin.

Input: per length bin, the measured tail α (e.g. 5th percentile) at each profiled budget, as
`{bin: {budget_blocks: alpha}}`, where budget_blocks is the total number of blocks a row attends
(sink and recent blocks included, as in Sparrow's profiled "16 × 32 … 16 × 1024" configurations).
Decode cost grows with the budget in every bin and bins are independent, so choosing per bin the
smallest budget that meets τ minimises the rollout's cost. Rules:

- `rule="cheapest"`: the smallest measured budget whose own α ≥ τ − tolerance.
  `rule="stable"`: the smallest budget b such that every measured budget ≥ b also meets it, so a
  lucky small budget in noisy, non-monotone measurements is not picked. Both coincide when α
  increases with the budget; the report flags bins where it does not.
- A bin with measurements but no budget meeting τ is dense (None) and reported as `dense_unmet`.
- A bin without measurements takes the choice of the nearest measured bin (ties go to the longer
  bin, which needs the larger budget) with `missing="nearest"`, or is dense with `missing="dense"`.
"""

import math
from dataclasses import dataclass, replace
from typing import Literal, Mapping

from sparrow.acceptance import AlphaHistogram
from sparrow.schedule import SPARROW_EDGES, SparsitySchedule

from .rollout import CostModel

Reason = Literal["measured", "nearest", "dense_unmet", "dense_missing"]


@dataclass(frozen=True)
class BinChoice:
    bin: int
    budget_blocks: int | None
    """Total blocks attended (sink + top-k + recent); None = dense."""
    alpha: float | None
    """Measured tail α at the chosen budget, in the bin that decided it."""
    reason: Reason
    source_bin: int | None
    """Bin whose measurements decided this one (itself when measured; None when dense_missing)."""
    monotone: bool | None
    """Whether the decisive bin's α never decreases as the budget grows (None when unmeasured)."""
    cost_share: float | None = None
    """Fraction of the rollout's predicted decode seconds spent in this bin (needs a cost model)."""


@dataclass(frozen=True)
class OptimisedSchedule:
    schedule: SparsitySchedule
    bins: tuple[BinChoice, ...]
    target: float

    @property
    def unmet_bins(self) -> list[int]:
        return [b.bin for b in self.bins if b.reason == "dense_unmet"]

    @property
    def fallback_bins(self) -> list[int]:
        return [b.bin for b in self.bins if b.reason in ("nearest", "dense_missing")]


def _choose(curve: dict[int, float], floor: float, rule: str) -> int | None:
    budgets = sorted(curve)
    if rule == "cheapest":
        return next((b for b in budgets if curve[b] >= floor), None)
    chosen = None
    for b in reversed(budgets):
        if curve[b] < floor:
            break
        chosen = b
    return chosen


def _validated(alpha_tail: Mapping[int, Mapping[int, float]], template: SparsitySchedule) -> dict[int, dict[int, float]]:
    table: dict[int, dict[int, float]] = {}
    reserved = template.sink + template.recent
    for b, curve in alpha_tail.items():
        if not isinstance(b, int) or not 0 <= b < template.num_bins:
            raise ValueError(f"alpha_tail bin {b!r}: must be an integer in [0, {template.num_bins})")
        for budget, alpha in curve.items():
            if not isinstance(budget, int) or budget < reserved:
                raise ValueError(
                    f"alpha_tail[{b}] budget {budget!r}: must be an integer >= {reserved} blocks "
                    f"(budgets count sink {template.sink} + recent {template.recent} blocks)"
                )
            if not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or not 0.0 <= alpha <= 1.0:
                raise ValueError(f"alpha_tail[{b}][{budget}]={alpha!r}: must be a number in [0, 1]; drop unmeasured budgets")
        if curve:
            table[b] = {int(k): float(v) for k, v in curve.items()}
    if not table:
        raise ValueError("alpha_tail has no measurements; measure at least one (bin, budget)")
    return table


def optimise_schedule(
    alpha_tail: Mapping[int, Mapping[int, float]],
    target: float,
    *,
    template: SparsitySchedule | None = None,
    name: str | None = None,
    rule: Literal["cheapest", "stable"] = "cheapest",
    missing: Literal["nearest", "dense"] = "nearest",
    tolerance: float = 0.0,
    cost_model: CostModel | None = None,
) -> OptimisedSchedule:
    """Per bin, the smallest budget meeting `target` (see the module docstring for the exact rules).

    `template` supplies bins, block size, sink and recent (default: Sparrow's 20 bins of 2000
    tokens, block 16, sink 1, recent 2); the result is `template.with_topk(...)`, so its version is
    the template's plus one. With `cost_model`, each bin reports its share of predicted decode time.
    """
    if not 0.0 < target <= 1.0:
        raise ValueError(f"target={target}: must be in (0, 1], e.g. 0.86")
    if not 0.0 <= tolerance < target:
        raise ValueError(f"tolerance={tolerance}: must be in [0, target)")
    if rule not in ("cheapest", "stable"):
        raise ValueError(f"rule={rule!r}: use 'cheapest' or 'stable'")
    if missing not in ("nearest", "dense"):
        raise ValueError(f"missing={missing!r}: use 'nearest' or 'dense'")
    template = template or SparsitySchedule(name="template", topk_blocks=(0,) * (len(SPARROW_EDGES) + 1))
    table = _validated(alpha_tail, template)
    floor = target - tolerance

    decided: dict[int, BinChoice] = {}
    for b, curve in table.items():
        budget = _choose(curve, floor, rule)
        ordered = [curve[k] for k in sorted(curve)]
        decided[b] = BinChoice(
            bin=b, budget_blocks=budget, alpha=None if budget is None else curve[budget],
            reason="measured" if budget is not None else "dense_unmet", source_bin=b,
            monotone=all(x <= y for x, y in zip(ordered, ordered[1:])),
        )

    choices = []
    for b in range(template.num_bins):
        if b in decided:
            choices.append(decided[b])
        elif missing == "dense":
            choices.append(BinChoice(b, None, None, "dense_missing", None, None))
        else:
            src = min(decided, key=lambda m: (abs(m - b), -m))
            choices.append(replace(decided[src], bin=b, reason="nearest"))

    reserved = template.sink + template.recent
    topk = [None if c.budget_blocks is None else c.budget_blocks - reserved for c in choices]
    schedule = replace(
        template.with_topk(topk, name=name or f"optimised-{target:g}"),
        source=f"optimise_schedule(target={target:g}, rule={rule}, missing={missing}, tolerance={tolerance:g})",
    )
    if cost_model is not None:
        seconds = cost_model.rollout_cost(schedule).by_bin(schedule, "seconds")
        total = seconds.sum()
        choices = [replace(c, cost_share=float(seconds[c.bin] / total)) for c in choices]
    return OptimisedSchedule(schedule=schedule, bins=tuple(choices), target=target)


def alpha_tail_from_histograms(histograms: Mapping[int, AlphaHistogram], pct: float = 5.0) -> dict[int, dict[int, float]]:
    """`{budget_blocks: AlphaHistogram}` (one calibration run per budget) → `{bin: {budget_blocks: α_pct}}`.

    Empty bins are left out, so the optimiser's missing-bin rule applies to them. The histograms'
    length bins must be the schedule's bins.
    """
    table: dict[int, dict[int, float]] = {}
    for budget, hist in histograms.items():
        for row in hist.summary(pct):
            table.setdefault(row["bin"], {})[int(budget)] = row[f"p{pct:g}"]
    return table
