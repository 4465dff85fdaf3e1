"""The run report: PNG plots and `report.md` from a run directory's metrics and controller logs.

    python -m sparrow.coordinator.report RUN_DIR      # (re)write RUN_DIR/report/
"""

import sys
from pathlib import Path

import yaml

from sparrow.schedule import SparsitySchedule
from sparrow.tables import format_table

from .progress import bin_values, fmt
from .run_dir import RunDir
from .step_record import LOOSE_BOUND_GAP, StepRecord, loose_tail_advice, mean_known

PLOTS = {
    "reward.png": "Reward per step",
    "response_length.png": "Response length per step",
    "alpha_tail.png": "Tail α per length bin vs τ",
    "budgets.png": "KV budget per length bin over steps",
    "eval_accuracy.png": "Held-out accuracy by policy version",
}


def _target(run_dir: RunDir) -> float:
    config = yaml.safe_load(run_dir.config_file.read_text()) if run_dir.config_file.exists() else {}
    return float(((config or {}).get("controller") or {}).get("target", 0.86))


def plot(run_dir: RunDir, rows: list[StepRecord], target: float) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = run_dir.report
    out.mkdir(parents=True, exist_ok=True)
    steps = [r.step + 1 for r in rows]
    files = []

    def save(fig, ax, name, ylabel, xlabel="step"):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(PLOTS[name])
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(out / name)

    fig, ax = plt.subplots(figsize=(6, 3.6))
    mean, std = [r.rollout.reward_mean for r in rows], [r.rollout.reward_std for r in rows]
    count = [r.rollout.samples - r.rollout.failed for r in rows]
    ax.plot(steps, mean, "o-", label="mean reward")
    if all(m is not None and s is not None for m, s in zip(mean, std)):
        se = [s / max(n, 1) ** 0.5 for s, n in zip(std, count)]
        ax.fill_between(steps, [m - e for m, e in zip(mean, se)], [m + e for m, e in zip(mean, se)], alpha=0.2,
                        label="± standard error")
    save(fig, ax, "reward.png", "reward")

    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.plot(steps, [r.rollout.response_length_mean for r in rows], "o-", label="mean")
    ax.plot(steps, [r.rollout.response_length_max for r in rows], "s--", label="max", alpha=0.7)
    save(fig, ax, "response_length.png", "generated tokens")

    edges = rows[-1].schedule.edges
    names = _bin_names(edges)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    exact = any(r.alpha_exact is not None for r in rows)
    for b in range(len(names)):
        values = [r.alpha.p5[b] if r.alpha.tokens[b] else None for r in rows]
        if any(v is not None for v in values):
            line, = ax.plot(steps, [float("nan") if v is None else v for v in values], "o-", label=f"bin {b} ({names[b]})")
            if exact:  # trainer.exact_alpha: α itself, dashed in the bin's colour
                tails = [r.alpha_exact.p5[b] if r.alpha_exact is not None and r.alpha_exact.tokens[b] else None for r in rows]
                ax.plot(steps, [float("nan") if v is None else v for v in tails], "x--", color=line.get_color())
    ax.axhline(target, color="k", ls="--", lw=1, label=f"τ = {target:g}")
    save(fig, ax, "alpha_tail.png", f"p{rows[-1].alpha.percentile:g} of α ({'lower bound: o, exact: x' if exact else 'lower bound'})")

    fig, ax = plt.subplots(figsize=(6, 3.6))
    history = [rows[0].schedule.blocks_before] + [r.schedule.blocks for r in rows]
    dense_y = max((b for blocks in history for b in blocks if b is not None), default=1) + 2
    x = [steps[0] - 1] + steps
    for b in range(len(names)):
        offset = (b - (len(names) - 1) / 2) * 0.08  # equal budgets stay visible side by side
        y = [(dense_y if blocks[b] is None else blocks[b]) + offset for blocks in history]
        ax.step(x, y, where="post", marker="o", ms=3, label=f"bin {b} ({names[b]})")
    ax.axhline(dense_y, color="grey", ls=":", lw=1)
    ax.text(x[0], dense_y, " dense", va="bottom", fontsize=8, color="grey")
    save(fig, ax, "budgets.png", "KV blocks attended (0 = initial)")

    evaluations = [e for r in rows for e in r.evaluations]
    if evaluations:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        for mode in sorted({x.mode for e in evaluations for x in e.results}):
            points = [(e.policy_version, x.accuracy) for e in evaluations for x in e.results if x.mode == mode]
            ax.plot([v for v, _ in points], [a for _, a in points], "o-", label=f"{mode} decoding")
        ax.set_ylim(-0.02, 1.02)
        save(fig, ax, "eval_accuracy.png", "accuracy", xlabel="policy version (0 = before training)")
    return files


def _bin_names(edges: list[int]) -> list[str]:
    """Token ranges of the bins (`SparsitySchedule.bin_range`: lengths are rounded up to whole blocks)."""
    bins = SparsitySchedule(name="bins", topk_blocks=(None,) * (len(edges) + 1), edges=tuple(edges))
    names = []
    for b in range(bins.num_bins):
        lo, hi = bins.bin_range(b)
        names.append(f"L≤{hi}" if lo <= 1 else f"L≥{lo}" if hi is None else f"L {lo}–{hi}")
    return names


def summary_table(rows: list[StepRecord], target: float) -> str:
    first, last = rows[0], rows[-1]
    elapsed = sum(r.timing.step for r in rows)
    utilisation = mean_known([u for r in rows for u in r.rollout.utilisation.values()])
    items = [
        ("steps", f"{first.step + 1}–{last.step + 1}"),
        ("time in steps", f"{elapsed:.0f} s ({elapsed / len(rows):.0f} s/step)"),
        ("per step: rollout wait / train / publish",
         f"{mean_known(r.timing.rollout_wait for r in rows):.0f} / {mean_known(r.timing.train for r in rows):.0f} / "
         f"{mean_known(r.timing.publish for r in rows):.1f} s"),
        ("samples, tokens generated", f"{sum(r.rollout.samples for r in rows)}, {sum(r.rollout.tokens for r in rows)}"),
        ("reward (first → last step)", f"{fmt(first.rollout.reward_mean)} → {fmt(last.rollout.reward_mean)}"),
        ("accuracy (first → last step)", f"{fmt(first.rollout.accuracy)} → {fmt(last.rollout.accuracy)}"),
        ("response length (first → last)",
         f"{fmt(first.rollout.response_length_mean, '.1f')} → {fmt(last.rollout.response_length_mean, '.1f')}"),
        ("KV read vs dense (mean)", fmt(mean_known(r.rollout.kv_read_fraction for r in rows))),
        ("measured speedup (dense probes, mean)", fmt(mean_known(r.rollout.speedup_measured for r in rows), ".2f")),
        ("predicted speedup (last, cost model)", fmt(last.predicted_speedup, ".2f")),
        ("rollout worker utilisation (mean)", fmt(utilisation, ".2f")),
        ("busy-batch fraction / tail share (mean)",
         f"{fmt(mean_known(r.rollout.busy_batch_fraction for r in rows), '.2f')} / "
         f"{fmt(mean_known(r.rollout.tail_share for r in rows), '.2f')}"),
        ("steps whose α tail was only bracketed (top-k bounds > "
         f"{LOOSE_BOUND_GAP:g} apart)", str(sum(bool(r.alpha.loose_bins()) for r in rows))),
        ("groups carried over / samples resumed / trained tokens from an older policy (partial rollouts)",
         f"{sum(r.rollout.carried_out for r in rows)} / {sum(r.rollout.resumed_samples for r in rows)} / "
         f"{sum(r.rollout.stale_tokens for r in rows)} of {sum(r.rollout.tokens for r in rows)}"),
        ("steps closed by their time budget (partial rollouts)", str(sum(r.rollout.closed_by_budget for r in rows))),
        ("most policy versions a trained sample lagged", str(max((r.rollout.staleness_max or 0) for r in rows))),
        ("groups generated again (lost workers)", str(sum(r.rollout.requeued for r in rows))),
        ("groups also given to a second worker (speculation)", str(sum(r.rollout.speculated for r in rows))),
        ("final blocks per bin", " ".join("dense" if b is None else str(b) for b in last.schedule.blocks)),
        ("schedule version", str(last.schedule.version)),
        ("budget changes by the controller", str(sum(r.controller.changes for r in rows))),
        (f"bins below τ={target:g} at the last step (lower bound)", ", ".join(map(str, last.alpha.bins_below(target))) or "none"),
    ]
    if last.alpha_exact is not None:
        items.append((f"bins below τ={target:g} at the last step (exact α)",
                      ", ".join(map(str, last.alpha_exact.bins_below(target))) or "none"))
    return format_table(["", "value"], [list(i) for i in items])


def per_step_table(rows: list[StepRecord]) -> str:
    """One row per step; with trainer.exact_alpha the tail's upper bound and exact value sit beside the lower bound."""
    exact = any(r.alpha_exact is not None for r in rows)
    out = []
    for r in rows:
        tails = [bin_values(r.alpha.p5, r.alpha.tokens)]
        if exact:
            tails += [bin_values(r.alpha.p5_upper or [None] * len(r.alpha.p5), r.alpha.tokens),
                      "-" if r.alpha_exact is None else bin_values(r.alpha_exact.p5, r.alpha_exact.tokens)]
        blocks = " ".join("d" if b is None else str(b) for b in r.schedule.blocks)
        util = " ".join(f"{u:.2f}" for u in r.rollout.utilisation.values()) or "-"
        out.append([r.step + 1, fmt(r.rollout.reward_mean), fmt(r.rollout.response_length_mean, ".1f"), *tails, blocks,
                    fmt(r.rollout.kv_read_fraction, ".2f"), fmt(r.rollout.tokens_per_s, ".0f"), util,
                    fmt(r.rollout.tail_share, ".2f"), f"{r.timing.step:.0f}"])
    alpha_heads = ["α p5 per bin"] + (["α p5 upper bound", "exact α p5"] if exact else [])
    return format_table(["step", "reward", "length", *alpha_heads, "blocks after", "KV read", "tok/s", "utilisation",
                         "tail", "s"], out)


def loose_tail_note(rows: list[StepRecord]) -> list[str]:
    """A warning paragraph when the top-k bounds could not pin down the tail (else nothing)."""
    loose = [r for r in rows if r.alpha.loose_bins()]
    if not loose:
        return []
    worst = max(g for r in loose for g in r.alpha.bound_gaps if g is not None)
    return [
        f"**The α tail was only bracketed in {len(loose)} of {len(rows)} steps**: the upper and lower top-k bounds of "
        f"its p{rows[0].alpha.percentile:g} differed by up to {worst:.2f} (more than {LOOSE_BOUND_GAP:g}), so the top-k "
        "lists miss much of the distribution and the lower bound is pessimistic: " + loose_tail_advice(None) + ".",
        "",
    ]


def eval_table(rows: list[StepRecord]) -> str:
    evaluations = [e for r in rows for e in r.evaluations]
    if not evaluations:
        return "no held-out evaluation (data.eval.every = 0)"
    return format_table(
        ["policy", "mode", "decoding", "prompts", "accuracy", "mean reward", "length", "s"],
        [[e.policy_version, x.mode, e.decoding, e.prompts, fmt(x.accuracy), fmt(x.reward_mean),
          fmt(x.response_length_mean, ".1f"), f"{x.seconds:.0f}"] for e in evaluations for x in e.results],
    )


def faults_table(rows: list[StepRecord]) -> str:
    events = [(r.step + 1, e) for r in rows for e in r.faults]
    if not events:
        return "none"
    return format_table(["step", "kind", "who", "recovery s", "detail"],
                        [[s, e.kind, e.subject, fmt(e.recovery_seconds, ".1f"), e.detail] for s, e in events])


def write_report(run_dir: RunDir | str | Path) -> Path:
    run_dir = run_dir if isinstance(run_dir, RunDir) else RunDir(run_dir)
    rows = [StepRecord.from_dict(r) for r in RunDir.read_jsonl(run_dir.metrics_file)]
    if not rows:
        raise ValueError(f"{run_dir.metrics_file}: no steps recorded yet; nothing to report")
    decisions = RunDir.read_jsonl(run_dir.decisions_file)
    target = _target(run_dir)
    files = plot(run_dir, rows, target)
    changes = [(d["step"] + 1, c["bin"], c["old"], c["new"], c["reason"]) for d in decisions for c in d["decisions"] if c["old"] != c["new"]]
    change_table = format_table(["step", "bin", "old top-k", "new top-k", "reason"],
                                [["dense" if v is None else v for v in row] for row in changes]) if changes else "none"
    text = "\n".join([
        f"# Sparrow training report: {run_dir.path.name}",
        "",
        "```", summary_table(rows, target), "```",
        "",
        *loose_tail_note(rows),
        "## Per step",
        "",
        "α p5 is the lower bound of the tail of the per-token acceptance rate per length bin (`-`: no tokens); "
        "blocks are the KV blocks attended per bin after the step's controller decision (`d` = dense).",
        "",
        "```", per_step_table(rows), "```",
        "",
        "## Held-out evaluation",
        "",
        "The `data.eval` prompts scored with each evaluated policy, decoded densely and under the schedule in force.",
        "",
        "```", eval_table(rows), "```",
        "",
        "## Faults and recovery",
        "",
        "Failures the job recovered from, and pool resizes; recovery is from detection until the replacement "
        "served (a lost trainer: until training resumed from the last checkpoint).",
        "",
        "```", faults_table(rows), "```",
        "",
        "## Controller changes",
        "",
        "```", change_table, "```",
        "",
        "## Plots",
        "",
        *[f"![{PLOTS[f.name]}]({f.name})" for f in files],
        "",
    ])
    path = run_dir.report / "report.md"
    path.write_text(text)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m sparrow.coordinator.report RUN_DIR")
    print(write_report(sys.argv[1]))
