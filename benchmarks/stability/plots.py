"""The study's PNGs: reward, per-bin p5 α vs τ, budgets per bin and rollout seconds, per step, one line per arm."""

from pathlib import Path


def _figure(arms: list[dict], key, title: str, ylabel: str, path: Path, tau: float | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for arm in arms:
        steps = [s["step"] + 1 for s in arm["steps"]]
        values = [key(s) for s in arm["steps"]]
        ax.plot(steps, [float("nan") if v is None else v for v in values], marker=".", label=arm["label"])
    if tau is not None:
        ax.axhline(tau, color="k", linestyle="--", linewidth=1, label="τ")
        ax.axhspan(tau, tau + 0.02, color="g", alpha=0.1)
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _per_bin(arms: list[dict], field: str, title: str, ylabel: str, path: Path, tau: float | None = None) -> Path:
    """One panel per length bin."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins = max((len(s[field]) for a in arms for s in a["steps"]), default=1)
    fig, axes = plt.subplots(1, bins, figsize=(3.2 * bins, 3.6), sharey=True, squeeze=False)
    edges = arms[0]["edges"] if arms else []
    for b, ax in enumerate(axes[0]):
        for arm in arms:
            steps = [s["step"] + 1 for s in arm["steps"]]
            values = [s[field][b] if b < len(s[field]) else None for s in arm["steps"]]
            ax.plot(steps, [float("nan") if v is None else v for v in values], marker=".", label=arm["label"])
        if tau is not None:
            ax.axhline(tau, color="k", linestyle="--", linewidth=1)
            ax.axhspan(tau, tau + 0.02, color="g", alpha=0.1)
        span = f"L <= {edges[b]}" if b < len(edges) else f"L > {edges[-1]}" if edges else "all L"
        ax.set_title(f"bin {b}: {span}", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(ylabel)
    axes[0][-1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _budgets(arm: dict) -> dict:
    """The arm with each step's blocks per bin (sink + recent + top-k), a dense bin drawn at its longest context's blocks."""
    dense = arm["dense_blocks"]
    steps = [dict(s, budget=[dense[b] if k is None else k for b, k in enumerate(s["blocks"])]) for s in arm["steps"]]
    return dict(arm, steps=steps)


def plot_all(arms: list[dict], out_dir: Path) -> list[Path]:
    tau = arms[0]["tau"] if arms else None
    exact = [a for a in arms if any(s.get("p5_alpha_exact") for s in a["steps"])]
    extra = [_per_bin(exact, "p5_alpha_exact", "exact p5 α (trainer.exact_alpha) per length bin vs τ", "p5 α",
                      out_dir / "alpha_p5_exact.png", tau)] if exact else []
    return extra + [
        _figure(arms, lambda s: s["reward_mean"], "rollout reward per step", "mean reward", out_dir / "reward.png"),
        _per_bin(arms, "p5_alpha", "p5 α (lower bound) per length bin vs τ", "p5 α", out_dir / "alpha_p5.png", tau),
        _per_bin([_budgets(a) for a in arms], "budget", "KV blocks read per length bin (dense = the bin's longest context)",
                 "blocks", out_dir / "budgets.png"),
        _figure(arms, lambda s: s["rollout_s"], "rollout seconds per step", "seconds", out_dir / "rollout_seconds.png"),
    ]
