"""The controller's first schedule: dense, a named table or schedule file, or a calibration file.

A calibration file holds offline measurements of the tail α per length bin and total budget, in
either form (JSON or YAML):

    {"percentile": 5, "alpha_tail": {"<bin>": {"<total blocks>": alpha, ...}, ...}}
    {"percentile": 5, "histograms": {"<total blocks>": AlphaHistogram.to_dict(), ...}}

plus, optionally, "all_statistics": {"lower" | "upper" | "exact": {"<total blocks>": histogram}}, from which
the histograms of the controller's statistic are used.

and `sparrow.cost.optimise_schedule` turns it into the cheapest schedule meeting τ (rule "stable",
so a lucky noisy small budget is not picked; unmeasured bins take their nearest measured neighbour).
A file that names its length-bin `edges` (`sparrow calibrate` writes them) must match the job's bins.
"""

import json
from pathlib import Path

import yaml

from sparrow.acceptance import AlphaHistogram
from sparrow.cost import alpha_tail_from_histograms, optimise_schedule
from sparrow.schedule import SPARROW_EDGES, ScheduleError, SparsitySchedule, load_schedule

from .config import ControllerConfig


def _calibration_table(path: Path, percentile: float, statistic: str, template: SparsitySchedule) -> dict[int, dict[int, float]]:
    """Tail α per bin and budget; from a file that carries the top-k bounds as well (`sparrow calibrate`
    writes exact α, lower and upper), the ones of the controller's own statistic, so its warm start
    agrees with what it will measure online."""
    if not path.exists():
        raise FileNotFoundError(f"calibration={str(path)!r}: no such file; run `sparrow calibrate` or fix the path")
    try:  # json for .json: PyYAML parses a large histogram file hundreds of times slower
        data = json.loads(path.read_text()) if path.suffix == ".json" else yaml.safe_load(path.read_text())
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"calibration {path}: not valid JSON/YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict) or ("alpha_tail" in data) == ("histograms" in data):
        raise ValueError(f"calibration {path}: expected a mapping with exactly one of 'alpha_tail' or 'histograms'")
    measured = data.get("percentile")
    if measured is None or float(measured) != percentile:
        raise ValueError(
            f"calibration {path}: percentile={measured!r} but the controller uses percentile={percentile:g}; "
            "recalibrate at the controller's percentile or change controller.percentile"
        )
    edges = data.get("edges")
    if edges is not None and (not isinstance(edges, list) or tuple(edges) != template.edges):
        raise ValueError(
            f"calibration {path}: measured with length-bin edges {edges} but the job's bins have edges "
            f"{list(template.edges)}; use the calibration's schedule.json as rollout.schedule (or set "
            "rollout.dense_bin_edges to its edges)"
        )
    try:
        if "histograms" not in data:
            return {int(b): {int(k): float(v) for k, v in curve.items()} for b, curve in data["alpha_tail"].items()}
        by_statistic = data.get("all_statistics") or {}
        if statistic in ("lower", "upper", "exact") and statistic in by_statistic:
            return _tails(by_statistic[statistic], percentile)
        if statistic == "midpoint" and {"lower", "upper"} <= by_statistic.keys():
            lower, upper = _tails(by_statistic["lower"], percentile), _tails(by_statistic["upper"], percentile)
            return {b: {k: (a + upper[b][k]) / 2 for k, a in curve.items()} for b, curve in lower.items()}
        return _tails(data["histograms"], percentile)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ValueError(f"calibration {path}: malformed table ({exc.__class__.__name__}: {exc})") from None


def _tails(histograms: dict, percentile: float) -> dict[int, dict[int, float]]:
    """Tail α per bin and budget from per-budget histograms (a 'dense' entry is the baseline, not a budget)."""
    hists = {int(budget): AlphaHistogram.from_dict(h) for budget, h in histograms.items() if budget != "dense"}
    return alpha_tail_from_histograms(hists, percentile)


def initial_schedule(config: ControllerConfig, template: SparsitySchedule | None = None) -> SparsitySchedule:
    """The warm-start schedule; `template` gives bins, block size, sink and recent for 'dense' and
    calibration starts (default: Sparrow's 20 bins of 2000 tokens, block 16, sink 1, recent 2)."""
    template = template or SparsitySchedule(name="controlled", topk_blocks=(None,) * (len(SPARROW_EDGES) + 1))
    if config.calibration is not None:
        table = _calibration_table(Path(config.calibration), config.percentile, config.statistic, template)
        result = optimise_schedule(table, config.target, template=template, rule="stable", name=f"controlled-{config.target:g}")
        return result.schedule
    if config.warm_start == "dense":
        return template.with_topk([None] * template.num_bins, version=template.version, name=f"controlled-{config.target:g}")
    try:
        return load_schedule(config.warm_start)
    except ScheduleError as exc:
        raise ValueError(f"controller.warm_start: {exc}") from None
