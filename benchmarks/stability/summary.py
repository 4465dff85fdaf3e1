"""Per-arm JSON from a run's step records, and the merged table's rows: pure (records in, plain data out)."""

from statistics import median

from sparrow.coordinator.step_record import mean_known

BAND = 0.02
"""An arm has converged once every measured bin's p5 α lies in [τ, τ + BAND]."""


def _rollout_seconds(rollout: dict) -> float | None:
    """Lease to last acknowledgement of the step's rollouts (tokens / tokens_per_s is how the record keeps it)."""
    rate = rollout.get("tokens_per_s")
    return rollout["tokens"] / rate if rate else None


def step_row(record: dict) -> dict:
    """What the study keeps of one `metrics.jsonl` line (StepRecord.to_dict)."""
    rollout, alpha, schedule, timing = record["rollout"], record["alpha"], record["schedule"], record["timing"]
    train = record.get("train") or {}
    exact_s = train.get("train/alpha_exact_seconds")
    return {
        "step": record["step"],
        "reward_mean": rollout["reward_mean"],
        "accuracy": rollout["accuracy"],
        "p5_alpha": alpha["p5"],  # the top-K lower bound (the statistic the record keeps as the tail)
        "p5_alpha_upper": alpha["p5_upper"],
        "alpha_tokens": alpha["tokens"],
        "topk_blocks": schedule["topk_blocks"],  # after this step's control: the next step's budgets
        "blocks": schedule["blocks_before"],
        "blocks_next": schedule["blocks"],
        "kv_read_fraction": rollout["kv_read_fraction"],
        "rollout_s": _rollout_seconds(rollout),
        "rollout_wait_s": timing["rollout_wait"],
        "step_s": timing["step"],
        "speedup_measured": rollout["speedup_measured"],
        "p5_alpha_exact": (record.get("alpha_exact") or {}).get("p5"),  # trainer.exact_alpha: α itself, per bin
        "exact_alpha_s": exact_s,
        "policy_update_s": None if "train/seconds" not in train else train["train/seconds"] - (exact_s or 0.0),
        "distill_s": train.get("distill/seconds"),
        "distill_kl": train.get("distill/kl"),
    }


def evaluations(records: list[dict], mode: str = "dense") -> list[dict]:
    """Held-out results of `mode`, in order: {policy_version, accuracy, reward_mean, prompts}."""
    out = []
    for record in records:
        for ev in record.get("evaluations") or []:
            for result in ev["results"]:
                if result["mode"] == mode:
                    out.append({"policy_version": ev["policy_version"], "accuracy": result["accuracy"],
                                "reward_mean": result["reward_mean"], "prompts": ev["prompts"]})
    return out


def arm_summary(arm: str, label: str, description: str, command: list[str], records: list[dict], capped: bool,
                returncode: int | None, tau: float, edges: list[int], dense_blocks: list[int]) -> dict:
    """The arm JSON; `dense_blocks` (per bin, the blocks of its longest context) places dense bins on the budget plot."""
    evals = evaluations(records)
    before = next((e for e in evals if e["policy_version"] == 0), None)
    after = next((e for e in reversed(evals) if e["policy_version"] > 0), None)
    return {"arm": arm, "label": label, "description": description, "command": command, "tau": tau, "edges": edges,
            "dense_blocks": dense_blocks,
            "steps": [step_row(r) for r in records], "eval_dense_before": before, "eval_dense_after": after,
            "evaluations_dense": evals, "wall_capped": capped, "returncode": returncode}


def in_band(p5: list[float | None], tau: float, band: float | None = BAND) -> bool:
    """Every measured bin at or above τ and, unless `band` is None, at most τ + band."""
    measured = [a for a in p5 if a is not None]
    return bool(measured) and all(tau <= a and (band is None or a <= tau + band) for a in measured)


STATISTICS = ("lower", "midpoint")
"""The per-bin p5 a convergence column reads: the top-K lower bound the records keep, or the midpoint of the lower
and upper bounds' p5s (close to what a controller on `statistic: midpoint` acts on; it pools a window of steps)."""


def step_p5(row: dict, statistic: str) -> list[float | None]:
    if statistic == "lower":
        return row["p5_alpha"]
    if statistic == "exact":
        return row.get("p5_alpha_exact") or []
    pairs = zip(row["p5_alpha"], row["p5_alpha_upper"])
    return [None if lo is None or hi is None else (lo + hi) / 2 for lo, hi in pairs]


def steps_to_band(arm: dict, statistic: str = "lower", band: float | None = BAND) -> int | None:
    """Steps run until the first step whose every measured bin has p5 α in [τ, τ + band] (band None: ≥ τ); None if
    never."""
    for i, row in enumerate(arm["steps"]):
        if in_band(step_p5(row, statistic), arm["tau"], band):
            return i + 1
    return None


def _median(values) -> float | None:
    """Per-step seconds: the median, since the first step also compiles kernels and captures graphs."""
    values = [v for v in values if v is not None]
    return median(values) if values else None


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _steps(count: int | None) -> str:
    return "never" if count is None else str(count)


def table_row(arm: dict) -> list[str]:
    """One arm's row of the merged table (TABLE_HEADERS)."""
    steps = arm["steps"]
    rewards = [s["reward_mean"] for s in steps]
    before, after = arm["eval_dense_before"], arm["eval_dense_after"]
    held = f"{_fmt(before and before['accuracy'], 2)} -> {_fmt(after and after['accuracy'], 2)}"
    reached = "/".join(_steps(steps_to_band(arm, statistic, band)) for band in (None, BAND) for statistic in STATISTICS)
    final = steps[-1]["topk_blocks"] if steps else []
    budgets = "/".join("dense" if k is None else str(k) for k in final)
    return [arm["label"], str(len(steps)), _fmt(rewards[-1] if rewards else None), _fmt(mean_known(rewards)), held,
            _fmt(_median(s["rollout_s"] for s in steps), 1), _fmt(_median(s["step_s"] for s in steps), 1),
            reached, budgets]


TABLE_HEADERS = ["arm", "steps", "final reward", "mean reward", "held-out acc (dense) before -> after",
                 "median rollout s/step", "median step s",
                 "steps to every bin's p5 >= tau (lower/midpoint) / in [tau, tau+0.02] (lower/midpoint)",
                 "final top-k per bin"]


def has_exact(arm: dict) -> bool:
    return any(s.get("p5_alpha_exact") for s in arm["steps"])


def _gap(steps: list[dict], hi: str, lo: str) -> float | None:
    """Mean over steps and bins of row[hi] − row[lo] where both are measured."""
    return mean_known(h - l for s in steps for h, l in zip(s.get(hi) or [], s.get(lo) or []) if h is not None and l is not None)


def exact_row(arm: dict) -> list[str]:
    """One arm's row of the exact-α table (EXACT_HEADERS): where the top-K bounds sit around α itself, and what the
    measurement and DistillSparse cost per step."""
    steps = arm["steps"]
    final = steps[-1].get("p5_alpha_exact") or [] if steps else []
    return [arm["label"], " ".join(_fmt(a) for a in final), _fmt(_gap(steps, "p5_alpha_exact", "p5_alpha")),
            _fmt(_gap(steps, "p5_alpha_upper", "p5_alpha_exact")),
            "/".join(_steps(steps_to_band(arm, "exact", band)) for band in (None, BAND)),
            _fmt(_median(s.get("policy_update_s") for s in steps), 1), _fmt(_median(s.get("exact_alpha_s") for s in steps), 1),
            _fmt(_median(s.get("distill_s") for s in steps), 1),
            " ".join(_fmt(s.get("distill_kl")) for s in steps) if any(s.get("distill_kl") is not None for s in steps) else "-"]


EXACT_HEADERS = ["arm", "final exact p5 α per bin", "mean exact − lower", "mean upper − exact",
                 "steps to exact p5 >= tau / in [tau, tau+0.02]", "median policy update s", "median exact α s",
                 "median DistillSparse s", "DistillSparse KL per step"]
