"""The sparsity controller on simulated α responses: convergence, safety, rate limits, hysteresis,
dense fallback, warm starts, persistence and config errors."""

import copy
import json

import numpy as np
import pytest
from pydantic import ValidationError

from sparrow.acceptance import AlphaHistogram
from sparrow.coordinator.controller import (
    REASONS,
    SPARROW_LADDER,
    ControllerConfig,
    PowerLawResponse,
    Simulator,
    SparsityController,
    TableResponse,
    cheapest_levels,
    initial_schedule,
    simulate,
)
from sparrow.coordinator.controller.simulation import beta_quantile
from sparrow.coordinator.controller.tail import row_percentiles
from sparrow.schedule import SparsitySchedule, load_schedule

TOKENS = 3000  # per bin and step: the noise level of a small RL step


def controller(warm_start="qwen3-1.7b-0.86", **overrides) -> SparsityController:
    cfg = ControllerConfig(warm_start=warm_start, **overrides)
    return SparsityController(cfg, initial_schedule(cfg))


def settled_levels(trace, last: int = 40, ctl=None) -> np.ndarray:
    """Per bin, the level held most often over the last steps (a probe in flight does not count);
    with `ctl`, levels covering a bin's longest sequence count as dense."""
    tail = trace.levels[-last:]
    levels = [np.bincount(col).argmax() for col in tail.T]
    return np.array(levels if ctl is None else [ctl.effective_level(b, lvl) for b, lvl in enumerate(levels)])


def confident_levels(ctl, response, margin: float) -> np.ndarray:
    return np.array(cheapest_levels(ctl, response, ctl.config.target + margin))


@pytest.mark.parametrize(
    "response, target, warm_start",
    [
        (PowerLawResponse(), 0.86, "qwen3-1.7b-0.75"),  # starts too sparse: must raise
        (PowerLawResponse(), 0.86, "qwen3-1.7b-0.94"),  # starts too dense: must lower
        (PowerLawResponse(d0=0.25, length_exponent=0.45), 0.88, "dense"),
        (PowerLawResponse(d0=0.12, budget_exponent=0.4), 0.80, "qwen3-4b-0.86"),
    ],
)
def test_converges_to_the_cheapest_budget_meeting_the_target(response, target, warm_start):
    ctl = controller(warm_start, target=target)
    trace = simulate(ctl, Simulator(response, TOKENS, seed=3), steps=150)
    cheapest = np.array(cheapest_levels(ctl, response, target))
    settled = settled_levels(trace, ctl=ctl)
    # Never below the cheapest level meeting τ; at most one level above the cheapest level that
    # meets τ by the statistical resolution of ~3000 tokens per step (0.01).
    assert (settled >= cheapest).all(), (settled, cheapest)
    assert (settled <= confident_levels(ctl, response, 0.01) + 1).all(), (settled, cheapest)
    assert (trace.violation_runs(target, tolerance=0.005) <= ctl.config.max_violation_steps).all()


def test_never_below_target_longer_than_max_violation_steps_even_after_a_drift():
    ctl = controller("qwen3-1.7b-0.86", max_violation_steps=2)
    sim = Simulator(PowerLawResponse(), TOKENS, seed=4)
    first = simulate(ctl, sim, steps=60)
    sim.response = PowerLawResponse(d0=0.24)  # the policy drifts: every budget now gives less α
    second = simulate(ctl, sim, steps=60)
    for trace in (first, second):
        assert (trace.violation_runs(0.86, tolerance=0.005) <= 2).all()
    raised = second.levels[-1] - first.levels[-1]
    assert (raised >= 0).all() and raised.sum() > 10


def test_min_samples_gate_pools_steps_and_never_judges_empty_bins():
    tokens = [900] * 10 + [0] * 10
    ctl = controller("qwen3-1.7b-0.75", min_samples=2500, window_steps=4)
    trace = simulate(ctl, Simulator(PowerLawResponse(), tokens, seed=0), steps=12)
    first_two = [d.reason for step in trace.decisions[:2] for d in step]
    assert set(first_two) == {"hold_insufficient_samples"}  # 900 and 1800 tokens < 2500
    assert trace.decisions[2][0].stats["count"] == 2700 and trace.decisions[2][0].reason != "hold_insufficient_samples"
    assert (trace.levels[:, 10:] == trace.levels[0, 10:]).all()  # bins without tokens never move
    assert all(step[b].reason == "hold_insufficient_samples" for step in trace.decisions for b in range(10, 20))


def test_rate_limits_bound_every_change():
    ctl = controller("qwen3-1.7b-0.75", max_raise_levels=2, max_lower_levels=1, max_violation_steps=50)
    trace = simulate(ctl, Simulator(PowerLawResponse(), TOKENS, seed=5), steps=60)
    steps = np.diff(trace.levels, axis=0)
    fallbacks = np.array([[d.reason == "dense_fallback" for d in step] for step in trace.decisions[:-1]])
    assert steps[~fallbacks].max() <= 2 and steps.min() >= -1
    assert (steps == 2).any() and (steps == -1).any()


def test_hysteresis_long_stable_run_changes_rarely():
    ctl = controller("qwen3-1.7b-0.86", model_memory_steps=200)
    trace = simulate(ctl, Simulator(PowerLawResponse(), TOKENS, seed=6), steps=300)
    changes = trace.changes(start=50)
    # After settling, a bin only re-probes the level below when its failed measurement expires
    # (every model_memory_steps): at most a lower and a raise per expiry.
    assert changes.max() <= 4, changes
    assert changes.sum() <= 2 * ctl.num_bins


def test_dense_fallback_when_the_target_is_unreachable_then_retries_with_backoff():
    levels = len(SPARROW_LADDER)
    tails = [[0.5 + 0.02 * i for i in range(levels)] for _ in range(2)]  # top sparse level: 0.84 < 0.86
    response = TableResponse(tuple(SPARROW_LADDER), tuple(map(tuple, tails)), dense=(0.97, 0.80))
    template = SparsitySchedule(name="t", topk_blocks=(1021, 1021), edges=(100_000,))
    cfg = ControllerConfig(dense_retry_steps=10, max_dense_retry_steps=40)
    ctl = SparsityController(cfg, template)
    trace = simulate(ctl, Simulator(response, TOKENS, seed=7), steps=80)
    reasons = [step[0].reason for step in trace.decisions]
    fallbacks = [i for i, r in enumerate(reasons) if r == "dense_fallback"]
    retries = [i for i, r in enumerate(reasons) if r == "dense_retry"]
    assert fallbacks[0] == 0 and retries and retries[0] == 10
    assert np.diff(fallbacks).tolist()[:3] == [11, 21, 41]  # retry intervals 10, 20, 40 (capped)
    assert set(reasons) <= {"dense_fallback", "dense_retry", "hold_dense_waiting"}
    # Bin 1: even dense stays below τ, so it stays dense and says so.
    assert set(step[1].reason for step in trace.decisions[1:]) == {"hold_dense_below_target"}


def test_emergency_jump_to_a_level_measured_safe():
    ladder = (29, 45, 61, 77, 93)
    # The model expects little gain per level, so raises are small; the third violation must jump.
    tails = ((0.70, 0.71, 0.72, 0.73, 0.90),)
    response = TableResponse(ladder, tails, dense=(0.98,))
    cfg = ControllerConfig(ladder=list(ladder), max_violation_steps=3, prior_slope=0.01, max_raise_levels=1)
    ctl = SparsityController(cfg, SparsitySchedule(name="t", topk_blocks=(93,), edges=()))
    sim = Simulator(response, TOKENS, seed=8)
    simulate(ctl, sim, steps=1)  # measure 93 as safe
    ctl.bins[0].level, ctl.bins[0].window = 0, type(ctl.bins[0].window)()
    ctl.schedule = ctl.schedule.with_topk([29])
    ctl._history[ctl.schedule.version] = (0,)
    trace = simulate(ctl, sim, steps=3)
    assert [step[0].reason for step in trace.decisions] == ["raise", "raise", "raise_emergency"]
    assert ctl.schedule.topk_blocks == (93,)


def test_every_decision_has_a_documented_reason_and_stats():
    ctl = controller("qwen3-1.7b-0.80")
    trace = simulate(ctl, Simulator(PowerLawResponse(), TOKENS, seed=9), steps=30)
    for step in trace.decisions:
        assert len(step) == ctl.num_bins
        for d in step:
            assert d.reason in REASONS
            assert d.stats["target"] == 0.86
            if d.reason != "hold_insufficient_samples":
                assert d.stats["count"] >= ctl.config.min_samples and d.stats["alpha_low"] <= d.stats["alpha"]
    raised = next(d for step in trace.decisions for d in step if d.reason == "raise")
    assert str(raised).startswith(f"bin {raised.bin}: {raised.old} -> {raised.new} (raise) α=")
    lower, _ = Simulator(PowerLawResponse(), TOKENS, seed=1).measure(ctl.schedule)
    step = ctl.step_with(lower, ctl.schedule.version)
    table = step.table(all_bins=True).splitlines()
    assert table[0].split() == ["bin", "old", "top-k", "new", "top-k", "reason", "tokens", "α", "tail", "α", "low"]
    assert len(table) == 2 + ctl.num_bins and len(step.table().splitlines()) == 2 + len(step.changes)


def test_schedule_version_bumps_only_on_change():
    ctl = controller("qwen3-1.7b-0.86")
    versions, changed = [], []
    sim = Simulator(PowerLawResponse(), TOKENS, seed=10)
    for _ in range(40):
        lower, _ = sim.measure(ctl.schedule)
        step = ctl.step_with(lower, ctl.schedule.version)
        versions.append(step.schedule.version)
        changed.append(step.changed)
    bumps = np.diff([0] + versions)
    assert (bumps == np.array(changed, dtype=int)).all() and any(changed) and not all(changed)


def test_late_statistics_are_attributed_to_the_schedule_that_made_them():
    ctl = controller("qwen3-1.7b-0.75")
    sim = Simulator(PowerLawResponse(), TOKENS, seed=11)
    old_version = ctl.schedule.version
    old_stats, _ = sim.measure(ctl.schedule)
    ctl.step_with(old_stats, old_version)  # raises most bins
    assert ctl.schedule.version == old_version + 1
    ctl.observe(old_stats, old_version)  # a slow trainer reports on the old schedule again
    assert all(not st.window for st in ctl.bins if st.level != 0)  # not pooled with the new budgets
    ctl.observe(old_stats, 999)
    assert "ignored α of schedule version 999" in ctl.decide().notes[0]
    with pytest.raises(ValueError, match="alpha has 3 length bins but the schedule has 20"):
        ctl.observe(AlphaHistogram.empty(3, 2000), ctl.schedule.version)
    with pytest.raises(ValueError, match="alpha has resolution 100 but earlier reports had 2000"):
        ctl.observe(AlphaHistogram.empty(20, 100), ctl.schedule.version)


def test_upper_bound_statistic_settles_cheaper_than_the_lower_bound():
    costs = {}
    for statistic in ("lower", "midpoint", "upper"):
        ctl = controller("qwen3-1.7b-0.86", statistic=statistic)
        trace = simulate(ctl, Simulator(PowerLawResponse(), TOKENS, seed=12, upper_gap=0.3), steps=80)
        costs[statistic] = settled_levels(trace).sum()
    assert costs["upper"] < costs["midpoint"] < costs["lower"]


def test_monotone_in_length_keeps_budgets_non_decreasing():
    ladder = tuple(SPARROW_LADDER)
    easy = tuple(0.80 + 0.01 * i for i in range(len(ladder)))
    hard = tuple(0.70 + 0.01 * i for i in range(len(ladder)))
    response = TableResponse(ladder, (hard, easy, hard), dense=(0.98,) * 3)
    template = SparsitySchedule(name="t", topk_blocks=(29, 29, 29), edges=(2000, 4000))
    for monotone in (False, True):
        ctl = SparsityController(ControllerConfig(monotone_in_length=monotone), template)
        trace = simulate(ctl, Simulator(response, TOKENS, seed=13), steps=60)
        final = trace.levels[-1]
        assert (np.diff(final) >= 0).all() == monotone
    assert any(d.reason == "monotone" for step in trace.decisions for d in step)


def test_warm_start_from_named_table_snaps_off_ladder_values_up():
    ctl = controller("qwen3-8b-0.86")
    assert ctl.schedule.topk_blocks[17] == 445  # 385 is not a profiled budget
    assert ctl.schedule.topk_blocks[:17] == load_schedule("qwen3-8b-0.86").topk_blocks[:17]
    assert "bin 17: warm-start top-k 385 is not on the ladder; using 445" in ctl.decide().notes


def test_warm_start_dense_and_from_schedule_file(tmp_path):
    assert controller("dense").schedule.topk_blocks == (None,) * 20
    path = tmp_path / "s.yaml"
    load_schedule("qwen3-4b-0.86").with_topk([61] * 20, name="mine").save(path)
    assert controller(str(path)).schedule.topk_blocks == (61,) * 20
    with pytest.raises(ValueError, match="controller.warm_start: schedule 'nope'"):
        initial_schedule(ControllerConfig(warm_start="nope"))


def test_warm_start_from_calibration_uses_the_cost_optimiser(tmp_path):
    response, template = PowerLawResponse(), SparsitySchedule(name="t", topk_blocks=(None,) * 20)
    table = {
        str(b): {str(v + 3): response.tail(template, b, v) for v in SPARROW_LADDER} for b in range(0, 20, 2)
    }
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps({"percentile": 5, "alpha_tail": table}))
    ctl = controller(calibration=str(path))
    expected = cheapest_levels(ctl, response, 0.86)
    got = [st.level for st in ctl.bins]
    assert got[::2] == expected[::2]  # measured bins: the cheapest budget meeting τ
    assert all(got[b] == got[b + 1] or got[b + 1] == expected[b + 2] for b in range(0, 18, 2))  # nearest measured

    hist_path = tmp_path / "hist.json"
    sim = Simulator(response, 4000, seed=0)
    hists = {str(v + 3): sim.measure(template.with_topk([v] * 20))[0].to_dict() for v in SPARROW_LADDER[5:]}
    hist_path.write_text(json.dumps({"percentile": 5, "histograms": hists}))
    from_hists = [st.level for st in controller(calibration=str(hist_path)).bins]
    assert np.abs(np.array(from_hists) - np.maximum(expected, 5)).max() <= 1

    path.write_text(json.dumps({"percentile": 10, "alpha_tail": table}))
    with pytest.raises(ValueError, match="percentile=10 but the controller uses percentile=5"):
        controller(calibration=str(path))
    with pytest.raises(FileNotFoundError, match="no such file"):
        controller(calibration=str(tmp_path / "missing.json"))


def test_state_round_trips_through_json_and_resumes_identically():
    ctl = controller("qwen3-1.7b-0.75")
    sim = Simulator(PowerLawResponse(), TOKENS, seed=14, upper_gap=0.1)
    simulate(ctl, sim, steps=25)
    resumed = SparsityController.from_state_dict(ctl.config, json.loads(json.dumps(ctl.state_dict())))
    sim_copy = copy.deepcopy(sim)
    a, b = simulate(ctl, sim, steps=25), simulate(resumed, sim_copy, steps=25)
    assert a.topk == b.topk and ctl.schedule == resumed.schedule
    other = ControllerConfig(ladder=[29, 61])
    with pytest.raises(ValueError, match="saved with ladder .* resume with the same ladder"):
        SparsityController.from_state_dict(other, ctl.state_dict())


def test_continuous_ladder_rounds_to_multiples_of_the_step():
    cfg = ControllerConfig(ladder=[29, 1021], ladder_step=64)
    assert cfg.levels()[:3] == (29, 64, 128) and cfg.levels()[-2:] == (960, 1021)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"target": 1.2}, "target"),
        ({"ladder": [61, 45]}, "must be strictly increasing"),
        ({"ladder": []}, "ladder is empty"),
        ({"dense_retry_steps": 100, "max_dense_retry_steps": 10}, "max_dense_retry_steps=10 is below dense_retry_steps=100"),
        ({"target": 0.995, "lower_margin": 0.01}, "no bin could ever show headroom"),
        ({"statistic": "mean"}, "statistic"),
        ({"budget": 5}, "Extra inputs are not permitted"),
    ],
)
def test_config_errors_name_the_field_and_the_fix(overrides, message):
    with pytest.raises(ValidationError, match=message):
        ControllerConfig(**overrides)


def test_tail_percentiles_match_alpha_histogram():
    rng = np.random.default_rng(0)
    hist = AlphaHistogram.empty(1, 2000)
    import torch

    hist.add(torch.from_numpy(rng.beta(8, 1, 5000)), torch.zeros(5000, dtype=torch.long))
    for pct in (1.0, 5.0, 50.0):
        assert row_percentiles(hist.counts[0].numpy(), np.array([pct / 100]))[0] == pytest.approx(
            float(hist.percentile(pct)[0]), abs=1e-12
        )


def test_simulated_tokens_have_the_response_tail():
    assert beta_quantile(1.0, 1.0, 0.3) == pytest.approx(0.3, abs=1e-6)  # uniform
    assert beta_quantile(2.0, 1.0, 0.25) == pytest.approx(0.5, abs=1e-5)  # CDF x²
    response = PowerLawResponse()
    sim = Simulator(response, 200_000, seed=0)
    schedule = load_schedule("qwen3-1.7b-0.86")
    measured = sim.measure(schedule)[0].percentile(5).numpy()
    assert np.abs(measured - sim.true_tails(schedule)).max() < 0.004
