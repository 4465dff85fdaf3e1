"""Plot the controller converging on a simulated α response (the figure in docs/controller.md).

    python -m sparrow.coordinator.controller.plot --out docs/img/controller_convergence.png

Starts from the qwen3-1.7b-0.75 table (too sparse for τ = 0.86), lets the response drift to a
harder one half-way (the policy changed), and prints final budgets against the oracle's.
"""

import argparse
import math

import numpy as np

from sparrow.tables import format_table

from .config import ControllerConfig
from .controller import SparsityController
from .simulation import PowerLawResponse, Simulator, Trace, cheapest_levels, simulate
from .warm_start import initial_schedule


def kv_read_fraction(ctl: SparsityController, topk_rows, tokens: np.ndarray) -> np.ndarray:
    """Per step, KV tokens read per decoded token relative to dense (Σ n_b·min(L_b, budget_b) / Σ n_b·L_b)."""
    s = ctl.schedule
    lengths = np.array([(lo + hi) / 2 if hi else lo + 1000 for lo, hi in map(s.bin_range, range(s.num_bins))])
    out = []
    for row in topk_rows:
        budget = np.array([math.inf if v is None else (v + s.sink + s.recent) * s.block_size for v in row])
        out.append((tokens * np.minimum(lengths, budget)).sum() / (tokens * lengths).sum())
    return np.array(out)


def run(steps: int, seed: int) -> tuple[SparsityController, Trace, list, list, np.ndarray]:
    cfg = ControllerConfig(warm_start="qwen3-1.7b-0.75")
    ctl = SparsityController(cfg, initial_schedule(cfg))
    tokens = np.array([6000] * 10 + [3000] * 10)
    responses = [PowerLawResponse(), PowerLawResponse(d0=0.21)]
    sim = Simulator(responses[0], tokens.tolist(), seed=seed)
    oracles = [cheapest_levels(ctl, r, cfg.target) for r in responses]
    first = simulate(ctl, sim, steps // 2)
    sim.response = responses[1]
    second = simulate(ctl, sim, steps - steps // 2)
    trace = Trace(
        np.concatenate([first.levels, second.levels]), first.topk + second.topk,
        np.concatenate([first.true_tail, second.true_tail]), np.concatenate([first.measured, second.measured]),
        first.decisions + second.decisions,
    )
    return ctl, trace, oracles, responses, tokens


def plot(out: str, steps: int, seed: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctl, trace, oracles, responses, tokens = run(steps, seed)
    tau, half = ctl.config.target, steps // 2
    s = ctl.schedule
    reserved = s.sink + s.recent
    to_tokens = lambda lvl: np.nan if lvl >= ctl.dense_level else (ctl.topk_of(lvl) + reserved) * s.block_size  # noqa: E731
    shown = [0, 4, 9, 14, 19]
    fig, axes = plt.subplots(3, 1, figsize=(10, 11), sharex=True)
    x = np.arange(steps)
    for b, color in zip(shown, plt.cm.viridis(np.linspace(0, 0.9, len(shown)))):
        axes[0].plot(x, [to_tokens(lvl) for lvl in trace.levels[:, b]], color=color, label=f"bin {b} ({s.bin_range(b)[0]}+ tokens)")
        oracle = [to_tokens(oracles[0][b])] * half + [to_tokens(oracles[1][b])] * (steps - half)
        axes[0].plot(x, oracle, color=color, ls=":", lw=1)
        axes[1].plot(x, trace.measured[:, b], color=color, lw=0.8, label=f"bin {b} measured p5")
        axes[1].plot(x, trace.true_tail[:, b], color=color, ls="--", lw=0.8)
    axes[0].set_yscale("log", base=2)
    axes[0].set_ylabel("KV budget (tokens)")
    axes[0].set_title("Budget per length bin (dotted: cheapest budget meeting τ)")
    axes[0].legend(fontsize=8, ncol=2)
    axes[1].axhline(tau, color="red", lw=1, label=f"τ = {tau}")
    axes[1].set_ylim(0.78, 1.0)
    axes[1].set_ylabel("p5 of α")
    axes[1].set_title("Tail α: measured (solid, ~3-6K tokens/bin/step) and true (dashed)")
    axes[1].legend(fontsize=8, ncol=3)
    cost = kv_read_fraction(ctl, trace.topk, tokens)
    oracle_cost = [kv_read_fraction(ctl, [tuple(ctl.topk_of(lvl) for lvl in o)], tokens)[0] for o in oracles]
    axes[2].plot(x, cost, label="controller")
    axes[2].plot(x, [oracle_cost[0]] * half + [oracle_cost[1]] * (steps - half), ls=":", label="oracle (cheapest meeting τ)")
    axes[2].set_ylabel("KV reads vs dense")
    axes[2].set_xlabel("training step")
    axes[2].set_title("Attention KV reads per decoded token, relative to dense")
    axes[2].legend(fontsize=8)
    for ax in axes:
        ax.axvline(half, color="gray", lw=0.8, ls="--")
    axes[0].annotate("policy drift: α worse at every budget", (half, axes[0].get_ylim()[1]), fontsize=8, ha="left", va="top")
    fig.tight_layout()
    fig.savefig(out, dpi=110)

    rows = []
    for b in range(ctl.num_bins):
        rows.append([b, ctl.topk_of(trace.levels[-1, b]) or "dense", ctl.topk_of(oracles[1][b]) or "dense",
                     int(trace.violation_runs(tau, 0.005)[b]), int(trace.changes(half + 30)[b])])
    print(format_table(["bin", "final top-k", "oracle top-k", "longest run < τ", "changes after settling"], rows))
    print(f"KV reads vs dense at the end: {cost[-1]:.3f} (oracle {oracle_cost[1]:.3f}); wrote {out}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparrow.coordinator.controller.plot", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/img/controller_convergence.png")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    plot(args.out, args.steps, args.seed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
