"""From the per-budget histograms to the result: the tail table, the cheapest schedule meeting τ,
the measurement file the controller's warm start reads, and the printed / Markdown tables. Pure."""

import math
from dataclasses import dataclass, replace

from sparrow.acceptance import AlphaHistogram
from sparrow.cost import CostModel, OptimisedSchedule, alpha_tail_from_histograms, optimise_schedule
from sparrow.schedule import SparsitySchedule

from .measure import REPLAY_TOLERANCE, STATISTICS, BudgetRun, Statistic


@dataclass(frozen=True)
class Cell:
    """One (length bin, budget) measurement."""

    count: int
    tail: float | None
    """The percentile of the chosen statistic's α; None without tokens."""
    mean: float | None
    """Mean exact α."""
    exact: float | None
    lower: float | None
    """The percentile of the top-K lower bound (Sparrow's statistic); None without top-K lists."""
    upper: float | None


@dataclass(frozen=True)
class CalibrationResult:
    template: SparsitySchedule
    runs: dict[int | None, BudgetRun]
    """By total budget in blocks; None is the dense baseline."""
    target: float
    percentile: float
    min_tokens: int
    statistic: Statistic
    optimised: OptimisedSchedule
    speedup: float | None
    """Predicted decode speedup of the chosen schedule over dense (cost model, seconds), if costed."""

    @property
    def budgets(self) -> list[int]:
        return sorted(b for b in self.runs if b is not None)

    @property
    def schedule(self) -> SparsitySchedule:
        return self.optimised.schedule

    def cell(self, length_bin: int, budget: int | None) -> Cell:
        run = self.runs[budget]
        n = int(run.exact.count()[length_bin])
        if n == 0:
            return Cell(0, None, None, None, None, None)
        p = self.percentile
        tails = {s: float(run.histogram(s).percentile(p)[length_bin]) if int(run.histogram(s).count()[length_bin]) else None
                 for s in STATISTICS}
        return Cell(count=n, tail=tails[self.statistic], mean=float(run.exact.mean()[length_bin]), **tails)

    def mean_length(self, length_bin: int) -> float | None:
        """Mean total length L of the tokens measured in a bin, over every budget (None if none were)."""
        count = sum(int(r.exact.count()[length_bin]) for r in self.runs.values())
        total = sum(float(r.length_sums[length_bin]) for r in self.runs.values())
        return total / count if count and total else None

    def measured_bins(self) -> list[int]:
        return [b for b in range(self.template.num_bins) if any(int(r.exact.count()[b]) for r in self.runs.values())]

    def warnings(self) -> list[str]:
        out = []
        for choice in self.optimised.bins:
            b = choice.bin
            if choice.reason == "dense_unmet":
                out.append(f"bin {b}: no profiled budget reaches τ={self.target:g}; it stays dense")
            if choice.reason != "measured":
                continue
            n = self.cell(b, choice.budget_blocks).count
            if n < self.min_tokens:
                out.append(f"bin {b}: the chosen budget {choice.budget_blocks} rests on {n} tokens (< {self.min_tokens}); "
                           "sample more or longer prompts to trust it")
            if choice.monotone is False:
                out.append(f"bin {b}: α does not grow monotonically with the budget (noise); the 'stable' rule chose "
                           f"{choice.budget_blocks}")
        fallback = [c.bin for c in self.optimised.bins if c.reason == "nearest"]
        if fallback:
            many = len(fallback) > 1
            out.append(f"bin{'s' if many else ''} {_ranges(fallback)} {'were' if many else 'was'} not reached by any rollout; "
                       f"{'they copy their' if many else 'it copies its'} nearest measured bin")
        dense = self.runs.get(None)
        if dense is not None and int(dense.lower.count().sum()):
            floor = float(pooled(dense.lower).percentile(self.percentile)[0])
            if floor < self.target:
                out.append(f"the dense rollout's p{self.percentile:g} of the top-K lower bound is {floor:.3f} < τ={self.target:g}: "
                           "the top-K lists miss too much of this model's probability mass, so a controller acting on "
                           "statistic 'lower' would find every bin below τ even when dense (raise --logprobs and the job's "
                           "logprobs, or run the controller on 'midpoint'/'upper')")
        for run in self.runs.values():
            if run.failed:
                out.append(f"budget {run.label}: {run.failed} samples failed ({'; '.join(run.errors[:2])})")
            if run.tokens and run.replay_tokens_off > 0.005 * run.tokens:
                cause = ("other blocks chosen on near-tied scores" if run.replay_block_mismatches else
                         "the same blocks attended: numeric differences between the engine's kernels and the recompute, "
                         "large in bfloat16/float16 and with FP8 pages, where a last-bit difference moves a value to the "
                         "next e4m3 step")
                out.append(f"budget {run.label}: {run.replay_tokens_off} of {run.tokens} tokens have |Δlog q| > "
                           f"{REPLAY_TOLERANCE:g} between the engine and the sparse recompute ({cause}); their α is the "
                           "recompute's")
            if run.replay_block_mismatches:
                out.append(f"budget {run.label}: {run.replay_block_mismatches} tokens' recomputed blocks differ from the "
                           "engine's; the sparse recompute does not replay the rollout exactly")
        return out

    def tail_table(self) -> list[dict]:
        """Every measured (bin, budget) cell, for readers of the measurement file."""
        rows = []
        for b in self.measured_bins():
            lo, hi = self.template.bin_range(b)
            cells = {}
            for budget, run in self.runs.items():
                c = self.cell(b, budget)
                if c.count:
                    p = f"p{self.percentile:g}"
                    cells[run.label] = {"count": c.count, "mean": c.mean, f"{p}_exact": c.exact,
                                        f"{p}_topk_lower": c.lower, f"{p}_topk_upper": c.upper}
            rows.append({"bin": b, "min_length": lo, "max_length": hi, "mean_length": self.mean_length(b), "budgets": cells})
        return rows


def _ranges(values: list[int]) -> str:
    parts, start = [], None
    for i, v in enumerate(values):
        start = v if start is None else start
        if i + 1 == len(values) or values[i + 1] != v + 1:
            parts.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return ", ".join(parts)


def assemble(
    template: SparsitySchedule,
    runs: dict[int | None, BudgetRun],
    target: float,
    percentile: float,
    min_tokens: int = 200,
    statistic: Statistic = "exact",
    cost_model: CostModel | None = None,
    name: str | None = None,
    notes: tuple[str, ...] = (),
) -> CalibrationResult:
    """The cheapest schedule meeting τ, chosen exactly as the controller's warm start does from the
    same measurement file (`optimise_schedule`, rule "stable", unmeasured bins take their nearest)."""
    histograms = {b: run.histogram(statistic) for b, run in runs.items() if b is not None}
    table = alpha_tail_from_histograms(histograms, percentile)
    if not table:
        raise ValueError(f"no {statistic} α was measured at any budget (every sample failed, generated nothing, "
                         "or had no top-K lists)")
    optimised = optimise_schedule(
        table, target, template=template, name=name or f"calibrated-{target:g}", rule="stable", cost_model=cost_model,
    )
    schedule = replace(optimised.schedule, notes=tuple(notes)) if notes else optimised.schedule
    optimised = replace(optimised, schedule=schedule)
    speedup = None
    if cost_model is not None:
        speedup = cost_model.compare(schedule).speedup_seconds
    return CalibrationResult(template, dict(runs), target, percentile, min_tokens, statistic, optimised, speedup)


def measurement_file(result: CalibrationResult, meta: dict) -> dict:
    """The controller's calibration format (`percentile` + `histograms` of the chosen statistic's α per
    total budget), plus what a reader needs to trust it: the bins, the dense baseline, every
    statistic's histograms, run counts and the tail table."""
    t = result.template
    runs = result.runs
    return {
        "percentile": result.percentile,
        "statistic": result.statistic,
        "histograms": {str(b): runs[b].histogram(result.statistic).to_dict() for b in result.budgets},
        "edges": list(t.edges),
        "block_size": t.block_size,
        "sink": t.sink,
        "recent": t.recent,
        "target": result.target,
        "dense_baseline": runs[None].histogram(result.statistic).to_dict() if None in runs else None,
        "all_statistics": {s: {runs[b].label: runs[b].histogram(s).to_dict() for b in runs} for s in STATISTICS},
        "runs": {runs[b].label: run_summary(runs[b]) for b in runs},
        "tail_table": result.tail_table(),
        "meta": meta,
    }


def run_summary(run: BudgetRun) -> dict:
    return {
        "samples": run.samples, "failed": run.failed, "tokens": run.tokens, "sparse_tokens": run.sparse_tokens,
        "replay_max_error": run.replay_max_error, "replay_tokens_off": run.replay_tokens_off,
        "replay_block_mismatches": run.replay_block_mismatches,
        "generate_seconds": round(run.generate_seconds, 3), "recompute_seconds": round(run.recompute_seconds, 3),
    }


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def pooled(hist: AlphaHistogram) -> AlphaHistogram:
    """All length bins as one."""
    return AlphaHistogram(hist.counts.sum(0, keepdim=True), hist.sums.sum(0, keepdim=True))


def _columns(result: CalibrationResult) -> list[int | None]:
    return result.budgets + ([None] if None in result.runs else [])


def alpha_table(result: CalibrationResult) -> tuple[list[str], list[list[str]]]:
    """Bins × budgets: the tail of the chosen statistic's α and the token count, `*` on the chosen budget, `?` on
    cells with fewer than `min_tokens` tokens; last columns: the choice and why."""
    p = f"p{result.percentile:g}"
    columns = _columns(result)
    headers = ["bin", "length (tokens)"] + [f"dense {p}" if b is None else f"{b} blocks {p}" for b in columns]
    rows = []
    for b in range(result.template.num_bins):
        choice = result.optimised.bins[b]
        cells = []
        for budget in columns:
            c = result.cell(b, budget)
            if c.count == 0:
                cells.append("-")
                continue
            mark = "*" if budget is not None and budget == choice.budget_blocks and choice.reason == "measured" else ""
            flag = "?" if c.count < result.min_tokens else ""
            cells.append(f"{c.tail:.3f}{mark}{flag} ({c.count})")
        if choice.budget_blocks is None:
            chosen = "dense"
        else:
            chosen = f"{choice.budget_blocks} ({choice.budget_blocks * result.template.block_size} tok)"
        reason = f"nearest (bin {choice.source_bin})" if choice.reason == "nearest" else choice.reason
        rows.append([str(b), result.template.bin_text(b), *cells, chosen, reason])
    return headers + ["chosen", "reason"], rows


def budget_table(result: CalibrationResult) -> tuple[list[str], list[list[str]]]:
    """Per budget over all bins: tokens, share decoded sparsely, mean and tail of exact α, the tail
    of the top-K interval, replay error and seconds: the gap between exact α and the statistic."""
    pct = result.percentile
    p = f"p{pct:g}"
    headers = ["budget", "samples", "tokens", "sparse share", "mean α", f"{p} α exact", f"{p} top-K lower",
               f"{p} top-K upper", "replay max Δlog q", f"replay > {REPLAY_TOLERANCE:g}", "generate s", "recompute s"]
    rows = []
    for budget in _columns(result):
        run = result.runs[budget]
        exact, lower, upper = (pooled(h) for h in (run.exact, run.lower, run.upper))
        has_bounds = int(lower.count()[0]) > 0
        rows.append([
            "dense" if budget is None else f"{budget} ({budget * result.template.block_size} tok)",
            str(run.samples) + (f" (+{run.failed} failed)" if run.failed else ""),
            str(run.tokens),
            f"{run.sparse_tokens / run.tokens:.2f}" if run.tokens else "-",
            _fmt(float(exact.mean()[0]) if run.tokens else None),
            _fmt(float(exact.percentile(pct)[0]) if run.tokens else None),
            _fmt(float(lower.percentile(pct)[0]) if has_bounds else None),
            _fmt(float(upper.percentile(pct)[0]) if has_bounds else None),
            f"{run.replay_max_error:.1e}",
            str(run.replay_tokens_off),
            f"{run.generate_seconds:.1f}",
            f"{run.recompute_seconds:.1f}",
        ])
    return headers, rows

