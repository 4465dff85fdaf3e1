"""`sparrow bench tail-model`: the step model drives the job's own `WorkQueue`; its arithmetic on fixed lengths,
its bookkeeping (each step trains prompts_per_step groups, none twice, the spares stay in flight), and why the
config refuses more spare groups than the staleness bound lets a step carry."""

import pytest

from sparrow.bench.tail_model import TailModel, simulate, steady


def _model(**over) -> TailModel:
    base = dict(prompts=4, samples=8, mean_tokens=3000, max_tokens=8192, decode_s=3.5e-3, decode_s_per_seq=3e-5,
                update_s=8.0)
    return TailModel(**{**base, **over})


def test_fixed_lengths_give_the_decode_arithmetic_and_no_tail():
    model = _model(prompts=2, samples=4, mean_tokens=1e12, max_tokens=100, decode_s=1e-3, decode_s_per_seq=1e-4,
                   update_s=1.0)
    steps = simulate(model, extra_groups=0, steps=3, carry="off")
    for i, s in enumerate(steps):
        assert s.rollout_s == pytest.approx(100 * (1e-3 + 8 * 1e-4))
        assert s.wall_s == pytest.approx(s.rollout_s + (1.0 if i else 0.0)), "a step's wall time: the update before it too"
        assert s.trained_tokens == 8 * 100 and s.tail_share == 0.0 and s.busy_batch_fraction == pytest.approx(8 / 256)


def test_kv_reads_charge_the_context_in_flight_and_a_sparse_cap_bounds_them():
    """8 samples of 100 tokens after 50-token prompts, 1 µs a token of context: the context attended grows from 50
    to 149 a sample (mean 99.5; the model charges a span its mean); capped at 60 tokens a sample it is ~60."""
    fixed = dict(prompts=2, samples=4, mean_tokens=1e12, max_tokens=100, decode_s=1e-3, decode_s_per_seq=1e-4,
                 update_s=1.0, kv_s_per_token=1e-6, prompt_tokens=50)
    dense = simulate(_model(**fixed), extra_groups=0, steps=2, carry="off")[0]
    assert dense.rollout_s == pytest.approx(100 * (1e-3 + 8e-4 + 8 * 99.5e-6), rel=1e-3)
    capped = simulate(_model(**fixed, kv_cap_tokens=60), extra_groups=0, steps=2, carry="off")[0]
    assert capped.rollout_s == pytest.approx(100 * (1e-3 + 8e-4 + 8 * 60e-6), rel=1e-2)
    long = dict(fixed, max_tokens=1000)
    assert simulate(_model(**long), 0, 1, carry="off")[0].rollout_s == pytest.approx(
        1000 * (1e-3 + 8e-4 + 8 * 549.5e-6), rel=1e-3), "spans of KV_SPAN tokens keep the growth's mean"


@pytest.mark.parametrize("extra, carry", [(0, "off"), (2, "resume"), (4, "resume")])
def test_each_step_trains_its_groups_once_and_the_spares_stay_in_flight(extra, carry):
    steps = simulate(_model(), extra_groups=extra, steps=12, seed=1, carry=carry)
    assert [s.trained_groups for s in steps] == [4] * 12
    assert [s.carried_out for s in steps] == [extra] * 12
    ids = [i for s in steps for i in s.trained_ids]
    assert len(ids) == len(set(ids)) == 12 * 4 * 8


def test_spares_beyond_what_the_staleness_bound_lets_a_step_carry_shrink_back():
    """One step of staleness: 5 spares for 4 prompts make the next step train all 5 carried groups (the bound),
    and the job queues only 4 new ones: 4 in flight from then on (the config refuses extra_groups=5 for this)."""
    steps = simulate(_model(), extra_groups=5, steps=6)
    assert steps[1].trained_groups == 5 and [s.carried_out for s in steps[2:]] == [4] * 4
    assert [s.carried_out for s in simulate(_model(carry_staleness=2), extra_groups=5, steps=6)] == [5] * 6


def test_spare_groups_cut_the_tail_of_geometric_lengths():
    sync = [steady(simulate(_model(), 0, 20, seed, carry="off"), warmup=3) for seed in range(3)]
    spares = [steady(simulate(_model(), 4, 20, seed), warmup=3) for seed in range(3)]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(spares, "wall_s") < 0.8 * mean(sync, "wall_s")
    assert mean(spares, "tail_share") < mean(sync, "tail_share") - 0.2


def test_carry_finish_decodes_the_carried_groups_before_the_update_and_the_next_step_may_need_no_rollout():
    """The sleep waits for groups that may not be interrupted: with as many spares as prompts, a step ends with all
    8 groups done and the next trains the 4 carried without decoding (half the steps: no rollout at all)."""
    steps = simulate(_model(), extra_groups=4, steps=12, seed=2, carry="finish")
    assert [s.trained_groups for s in steps] == [4] * 12
    idle = [s for s in steps if s.rollout_s == 0.0]
    assert len(idle) == 6 and all(s.tail_share is None for s in idle)
    ids = [i for s in steps for i in s.trained_ids]
    assert len(ids) == len(set(ids))


def test_async_hides_the_update_and_interrupting_at_each_version_cuts_its_tail():
    """Disaggregated, staleness 1: the next step's groups decode while the trainer updates. With partial rollouts
    off the engine drains its groups at every new version (the worker's barrier); interrupting and resuming them
    instead (0 spares) keeps it busy through it, and resumed spares more so."""
    disaggregated = dict(placement="disaggregated")

    def mean(model, extra, carry):
        return sum(steady(simulate(model, extra, 20, seed, carry), warmup=3)["wall_s"] for seed in range(3)) / 3

    asynchronous = _model(**disaggregated, staleness=1, carry_staleness=2)
    sync, drained = mean(_model(**disaggregated), 0, "off"), mean(asynchronous, 0, "off")
    assert sync - drained > 0.5 * 8.0, "most of the 8 s update is hidden"
    interrupted = mean(asynchronous, 0, "resume")
    assert interrupted < 0.8 * drained and mean(asynchronous, 4, "resume") < interrupted


def test_a_time_budget_grows_the_groups_in_flight_to_what_the_tail_needs():
    """No spares, sync: a budget that runs out mid-tail closes steps early until one step's prompts are in flight
    beyond the batch (the job's carry limit), then the steps train 4 groups again, as 4 spares would give; no group
    is trained twice."""
    budget = simulate(_model(close_after_s=5.0), extra_groups=0, steps=12, seed=1)
    assert any(s.trained_groups < 4 for s in budget[:3]) and max(s.carried_out for s in budget) <= 4
    ids = [i for s in budget for i in s.trained_ids]
    assert len(ids) == len(set(ids))
    off = [steady(simulate(_model(), 0, 20, seed, carry="off"), warmup=3)["wall_s"] for seed in range(3)]
    closed = [steady(simulate(_model(close_after_s=5.0), 0, 20, seed), warmup=3)["wall_s"] for seed in range(3)]
    assert sum(closed) < 0.8 * sum(off)
    with pytest.raises(ValueError, match="close_after_s=5.0 with carry='off'"):
        simulate(_model(close_after_s=5.0), 0, 3, carry="off")


def test_bad_inputs_name_the_field():
    with pytest.raises(ValueError, match="staleness=1 with placement='colocated'"):
        _model(staleness=1, carry_staleness=2)
    with pytest.raises(ValueError, match="carry_staleness=1 above it"):
        _model(placement="disaggregated", staleness=1)
    with pytest.raises(ValueError, match="max_num_seqs=4 < samples=8"):
        _model(max_num_seqs=4)
    with pytest.raises(ValueError, match="kv_cap_tokens=0"):
        _model(kv_cap_tokens=0)
    with pytest.raises(ValueError, match="close_after_s=0"):
        _model(close_after_s=0)
    with pytest.raises(ValueError, match="kv_s_per_token=-1"):
        _model(kv_s_per_token=-1)
    with pytest.raises(ValueError, match="mean_tokens=0"):
        _model(mean_tokens=0)
    with pytest.raises(ValueError, match="extra_groups=-1"):
        simulate(_model(), extra_groups=-1, steps=2)
    with pytest.raises(ValueError, match="carry='later'"):
        simulate(_model(), extra_groups=2, steps=2, carry="later")
    with pytest.raises(ValueError, match="extra_groups=2 with carry='off'"):
        simulate(_model(), extra_groups=2, steps=2, carry="off")
