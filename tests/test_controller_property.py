"""Property test: on random monotone α responses the controller keeps every bin that can reach τ
above it (up to max_violation_steps judged steps) and settles within one level of the cheapest."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sparrow.coordinator.controller import ControllerConfig, Simulator, SparsityController, TableResponse, cheapest_levels, simulate
from sparrow.schedule import SparsitySchedule

LADDER = (29, 45, 61, 93, 125, 189, 253, 381)
TARGET = 0.86


@st.composite
def responses(draw, bins: int = 3):
    tails, dense = [], []
    for _ in range(bins):
        start = draw(st.floats(0.55, 0.85))
        steps = draw(st.lists(st.floats(0.012, 0.06), min_size=len(LADDER) - 1, max_size=len(LADDER) - 1))
        curve = np.minimum(start + np.concatenate([[0.0], np.cumsum(steps)]), 0.97)
        tails.append(tuple(float(v) for v in curve))
        dense.append(max(draw(st.floats(0.80, 0.99)), float(curve[-1])))
    return TableResponse(LADDER, tuple(tails), tuple(dense))


@settings(max_examples=15, deadline=None, derandomize=True)
@given(response=responses(), start=st.lists(st.integers(0, len(LADDER)), min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_random_monotone_responses(response, start, seed):
    cfg = ControllerConfig(ladder=list(LADDER), target=TARGET)
    template = SparsitySchedule(
        name="t", topk_blocks=tuple(None if s == len(LADDER) else LADDER[s] for s in start), edges=(100_000, 200_000)
    )
    ctl = SparsityController(cfg, template)
    trace = simulate(ctl, Simulator(response, 3000, seed=seed), steps=120)

    reachable = np.array(response.dense) >= TARGET + 0.01
    runs = trace.violation_runs(TARGET, tolerance=0.005)
    assert (runs[reachable] <= cfg.max_violation_steps).all(), runs

    settled = np.array([np.bincount(col).argmax() for col in trace.levels[-30:].T])
    cheapest = np.array(cheapest_levels(ctl, response, TARGET))
    confident = np.array(cheapest_levels(ctl, response, TARGET + 0.015))
    ok = (settled >= cheapest) & (settled <= confident + 1)
    assert ok[reachable].all(), (settled, cheapest, confident)
