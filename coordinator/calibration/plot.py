"""`alpha_vs_length.png`: tail α per length bin, one line per budget, the τ line and the choice
(the style of Sparrow's Fig. 3a)."""

from pathlib import Path

from .table import CalibrationResult


def bin_positions(result: CalibrationResult, longest_context: int) -> list[float]:
    """Where each bin's point goes: the mean length L of the tokens measured in it, else the bin's
    centre (the open last bin ends at the longest context)."""
    positions = []
    for b in range(result.template.num_bins):
        lo, hi = result.template.bin_range(b)
        hi = max(hi if hi is not None else longest_context, lo)
        mean = result.mean_length(b)
        positions.append((lo + hi) / 2 if mean is None else mean)
    return positions


def plot_alpha_vs_length(result: CalibrationResult, path: str | Path, longest_context: int, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    x = bin_positions(result, longest_context)
    bins = result.measured_bins()
    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.cm.viridis(np.linspace(0.0, 0.9, max(len(result.budgets), 1)))
    bs = result.template.block_size
    any_few = False
    for budget, color in zip(result.budgets, colors):
        pts = [(x[b], result.cell(b, budget)) for b in bins]
        pts = [(xx, c) for xx, c in pts if c.count]
        if not pts:
            continue
        ax.plot([xx for xx, _ in pts], [c.tail for _, c in pts], "-o", color=color, ms=4,
                label=f"{bs} × {budget} ({budget * bs} tok)")
        few = [(xx, c.tail) for xx, c in pts if c.count < result.min_tokens]
        if few:
            ax.plot(*zip(*few), "o", mfc="white", mec=color, ms=6)
            any_few = True
    if None in result.runs:
        pts = [(x[b], result.cell(b, None)) for b in bins]
        pts = [(xx, c.tail) for xx, c in pts if c.count]
        if pts:
            ax.plot(*zip(*pts), "--", color="grey", lw=1, label="dense rollout (floor)")
    chosen = [(x[c.bin], c.alpha) for c in result.optimised.bins if c.reason == "measured" and c.bin in bins]
    if chosen:
        ax.plot(*zip(*chosen), "s", mfc="none", mec="black", ms=11, mew=1.5, label="chosen budget")
    if any_few:
        ax.plot([], [], "o", mfc="white", mec="grey", label=f"< {result.min_tokens} tokens")
    ax.axhline(result.target, color="red", ls=":", lw=1.2, label=f"τ = {result.target:g}")
    ax.set_xlabel("total length L = prompt + generated (tokens; mean of the bin's measured tokens)")
    ax.set_ylabel(f"p{result.percentile:g} of α per bin")
    ax.set_title(title or f"Tail acceptance vs length per KV budget (p{result.percentile:g})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
