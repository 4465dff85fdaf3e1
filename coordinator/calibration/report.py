"""`report.md` of a calibration run and the lines printed at its end. Pure string building."""

from pathlib import Path

from sparrow.tables import format_table, markdown_table

from .table import CalibrationResult, alpha_table, budget_table

LEGEND = ("cells: {p} of {stat} α (tokens); * = chosen budget, ? = fewer than {n} tokens, - = no tokens. "
          "Budgets are total blocks of {bs} tokens (sink + top-k + recent).")


def schedule_rows(result: CalibrationResult) -> tuple[list[str], list[list[str]]]:
    s = result.schedule
    headers = ["bin", "length (tokens)", "top-k", "blocks", "KV tokens", "cost share"]
    rows = []
    for choice in result.optimised.bins:
        blocks = s.blocks_for_bin(choice.bin)
        rows.append([
            str(choice.bin), s.bin_text(choice.bin),
            "dense" if s.topk_blocks[choice.bin] is None else str(s.topk_blocks[choice.bin]),
            "dense" if blocks is None else str(blocks), "dense" if blocks is None else str(blocks * s.block_size),
            "-" if choice.cost_share is None else f"{choice.cost_share:.2f}",
        ])
    return headers, rows


def controller_ladder(result: CalibrationResult) -> list[int]:
    """Top-k values of the profiled budgets: the ladder the controller should move on."""
    reserved = result.template.sink + result.template.recent
    return [b - reserved for b in result.budgets]


def usage(result: CalibrationResult, out: Path) -> str:
    return (
        "```yaml\n"
        f"rollout:\n  schedule: {out / 'schedule.json'}        # the job's bins and first schedule\n"
        f"controller:\n  target: {result.target:g}\n  percentile: {result.percentile:g}\n"
        f"  calibration: {out / 'measurements.json'}   # warm start: the same optimiser, same choice\n"
        f"  ladder: {controller_ladder(result)}        # top-k of the profiled budgets\n"
        "```"
    )


def console_summary(result: CalibrationResult, out: Path) -> str:
    p = f"p{result.percentile:g}"
    lines = [format_table(*alpha_table(result)),
             LEGEND.format(p=p, stat=result.statistic, n=result.min_tokens, bs=result.template.block_size), "",
             format_table(*budget_table(result)), ""]
    speed = "" if result.speedup is None else f"; predicted decode speedup {result.speedup:.2f}x over dense"
    lines.append(f"schedule {result.schedule.name}: top-k {list(result.schedule.topk_blocks)}{speed}")
    lines += [f"warning: {w}" for w in result.warnings()]
    lines.append(f"wrote {out}/measurements.json, schedule.json, alpha_vs_length.png, report.md")
    return "\n".join(lines)


def report_markdown(result: CalibrationResult, settings: dict, command: str, out: Path) -> str:
    p = f"p{result.percentile:g}"
    s = result.schedule
    parts = [
        f"# Calibration: {settings.get('model_name', settings.get('model'))}", "",
        f"`{command}`", "",
        markdown_table(["setting", "value"], [[k, f"`{v}`"] for k, v in settings.items()]), "",
        f"## Tail α ({p}) per length bin and KV budget", "",
        markdown_table(*alpha_table(result)), "",
        LEGEND.format(p=p, stat=result.statistic, n=result.min_tokens, bs=result.template.block_size), "",
        "![tail α vs length](alpha_vs_length.png)", "",
        "## Per budget, all bins pooled", "",
        "Exact α uses the full dense and sparse distributions; the top-K interval is what training "
        f"measures from the rollout's top-{settings.get('logprobs', 'K')} (its lower bound is Sparrow's statistic). "
        "`replay max Δlog q` is the largest absolute difference between the engine's log q of a sampled token and "
        "the sparse teacher-forced recompute; `replay > 0.001` counts the tokens where they differ by more.", "",
        markdown_table(*budget_table(result)), "",
        f"## Chosen schedule: `{s.name}` (τ = {result.target:g}, rule \"stable\")", "",
        markdown_table(*schedule_rows(result)), "",
    ]
    if result.speedup is not None:
        parts += [f"Predicted decode speedup over dense (cost model, {settings.get('hardware')}): "
                  f"**{result.speedup:.2f}x**.", ""]
    warnings = result.warnings()
    if warnings:
        parts += ["## Warnings", ""] + [f"- {w}" for w in warnings] + [""]
    parts += ["## Use it", "", usage(result, out), ""]
    return "\n".join(parts)
