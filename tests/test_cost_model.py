"""Cost model: paper formulas, the schedule-aware per-step sum, model shapes, the optimiser, `sparrow cost`."""

import json
import math

import numpy as np
import pytest
from safetensors import safe_open

from sparrow.acceptance import AlphaHistogram
from sparrow.cli.main import main
from sparrow.cost import (
    BUILTIN_MODELS, HARDWARE, CostModel, ModelShape, RolloutSpec, alpha_tail_from_histograms, appf_context_sum,
    appf_cost, optimise_schedule, resolve_hardware, resolve_model, sec33_dense, sec33_scoring, sec33_sparse,
)
from sparrow.schedule import SparsitySchedule, load_schedule, published_schedules

SYM = dict(P=10, N=2, L_in=3, L_out=4, D=5, r=2, I=7)


def fixed(topk: int, **kw) -> SparsitySchedule:
    return SparsitySchedule(name=f"fixed-{topk}", topk_blocks=(topk,) * 20, **kw)


# ---------------------------------------------------------------- shapes and hardware


@pytest.mark.parametrize(
    "name, total, non_embedding, r",
    [("qwen3-0.6b", "0.6", "0.44", 2), ("qwen3-1.7b", "1.7", "1.4", 2), ("qwen3-4b", "4.0", "3.6", 4),
     ("qwen3-8b", "8.2", "6.95", 4), ("qwen3-14b", "14.8", "13.2", 5)],
)
def test_builtin_shapes_match_model_card_parameter_counts(name, total, non_embedding, r):
    """Model cards print billions rounded to the digits given here."""
    s = BUILTIN_MODELS[name]
    for count, card in ((s.params, total), (s.non_embedding_params, non_embedding)):
        assert f"{count / 1e9:.{len(card.split('.')[1])}f}" == card
    assert s.gqa_ratio == r and s.kv_dim == s.layers * 8 * 128
    assert s.decode_params == s.non_embedding_params + s.vocab * s.hidden


def _checkpoint_params(model_dir) -> int:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama"])
def test_from_hf_config_counts_every_parameter_of_a_real_checkpoint(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    shape = ModelShape.from_hf_config(model_dir)
    assert (shape.layers, shape.q_heads, shape.kv_heads, shape.head_dim, shape.hidden) == (4, 4, 2, 32, 64)
    assert shape.qk_norm == (fixture == "tiny_qwen3")
    assert shape.params == _checkpoint_params(model_dir)
    assert resolve_model(str(model_dir / "config.json")) == shape


def test_from_hf_config_dict_defaults_and_biases():
    qwen2 = {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "tie_word_embeddings": True}
    s = ModelShape.from_hf_config(qwen2, name="q2")
    assert s.head_dim == 32 and s.bias_per_layer == 4 * 32 + 2 * 2 * 32 and not s.qk_norm
    llama = {k: v for k, v in qwen2.items() if k not in ("model_type", "num_key_value_heads", "tie_word_embeddings")}
    s = ModelShape.from_hf_config({**llama, "model_type": "llama"})
    assert s.kv_heads == 4 and s.gqa_ratio == 1 and not s.tied_embeddings and s.bias_per_layer == 0


def test_from_hf_config_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="missing key 'intermediate_size'"):
        ModelShape.from_hf_config({"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1, "vocab_size": 4})
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ModelShape.from_hf_config({"num_experts": 8})
    with pytest.raises(FileNotFoundError, match="no such file"):
        ModelShape.from_hf_config(tmp_path)
    with pytest.raises(ValueError, match="unknown model 'qwen3-5b': choose one of qwen3-0.6b"):
        resolve_model("qwen3-5b")
    with pytest.raises(ValueError, match="unknown hardware 'a100': choose one of h100, h200"):
        resolve_hardware("a100")


def test_h200_intensity_is_the_datasheet_ratio():
    assert HARDWARE["h200"].intensity == pytest.approx(989.4 / 4.8, rel=1e-12)
    assert HARDWARE["h100"].intensity == pytest.approx(989.4 / 3.35, rel=1e-12)


# ---------------------------------------------------------------- paper forms


def test_sec33_forms_by_hand():
    dense = sec33_dense(**SYM)
    assert (dense.compute, dense.memory, dense.eflops) == (960, 280, 960 + 7 * 280)
    corrected = sec33_scoring(N=2, L_in=3, L_out=4, D=5, r=2, I=7, page_size=2)
    printed = sec33_scoring(N=2, L_in=3, L_out=4, D=5, r=2, I=7, page_size=2, prefix_over_ps=False)
    assert (corrected.compute, corrected.memory) == (200, 100)
    assert (printed.compute, printed.memory) == (320, 160)
    sparse = sec33_sparse(**SYM, budget=3, page_size=2)
    assert (sparse.compute, sparse.memory) == (640 + 200, 240 + 100)


def test_appf_forms_by_hand():
    assert appf_context_sum(3, 4, 5) == 36  # L_dense = 2: (6 + 2)·2 + 2·5·2
    dense = appf_cost(**SYM, B=3)
    assert (dense.compute, dense.memory) == (480 + 2400, 80 + 1200)
    assert appf_context_sum(10, 4, 6) == 2 * 6 * 4  # K below the prompt: sparse from the first step


def test_appf_context_sum_against_brute_force_per_step_sum():
    rng = np.random.default_rng(0)
    for L_in, L_out, K in rng.integers(1, 3000, size=(200, 3)):
        steps = np.minimum(L_in + np.arange(1, L_out + 1), K)
        l_dense = max(0, min(L_out, K - L_in))
        # H is the continuous form: Σ 2·min(ctx, K) exceeds it by exactly L_dense (Σ_{t≤n} t = n²/2 + n/2)
        assert 2 * steps.sum() - appf_context_sum(L_in, L_out, K) == l_dense


def test_paper_forms_invariants():
    sym = dict(P=4e9, N=8, L_in=256, L_out=32000, D=147456, r=4, I=206.0)
    dense = appf_cost(**sym, B=1)
    assert appf_cost(**sym, B=1, K=256 + 32000) == dense
    assert appf_cost(**sym, B=1, K=10**9) == dense
    speedups = [sec33_dense(**sym).eflops / sec33_sparse(**sym, budget=b, page_size=16).eflops for b in (512, 2048, 8192)]
    assert speedups[0] > speedups[1] > speedups[2] > 1
    costs = [appf_cost(**{**sym, "L_out": n}, B=1, K=4096).eflops for n in (1000, 8000, 32000)]
    assert costs[0] < costs[1] < costs[2]


# ---------------------------------------------------------------- schedule-aware per-step sum


def test_dense_rollout_equals_appf_plus_the_discrete_sum_term():
    shape = BUILTIN_MODELS["qwen3-1.7b"]
    spec = RolloutSpec(prompt_len=300, gen_len=5000, samples=4, batch=3)
    dense = CostModel(shape, HARDWARE["h200"], spec).rollout_cost(None)
    D = shape.kv_dim * spec.kv_bytes
    f = appf_cost(P=shape.decode_params, B=3, N=4, L_in=300, L_out=5000, D=D, r=shape.gqa_ratio, I=HARDWARE["h200"].intensity)
    assert dense.flops == pytest.approx(f.compute + shape.gqa_ratio * 12 * D * 5000, rel=1e-12)
    assert dense.bytes == pytest.approx(f.memory + 12 * D * 5000, rel=1e-12)
    assert dense.eflops == pytest.approx(dense.flops + HARDWARE["h200"].intensity * dense.bytes, rel=1e-12)


def test_step_costs_match_a_per_step_loop_over_the_scalar_schedule_api():
    shape, hw = BUILTIN_MODELS["qwen3-4b"], HARDWARE["h100"]
    spec = RolloutSpec(samples=2, batch=1, dense_layers=2)
    schedule = load_schedule("qwen3-4b-0.86")
    around_edges = {L for e in schedule.edges[:4] for L in range(e - 40, e + 40)}
    lengths = np.array(sorted(around_edges | {1, 7, 500, 513, 30000}))
    got = CostModel(shape, hw, spec).step_costs(schedule, lengths)
    kv_tok = 2 * shape.kv_heads * shape.head_dim * 2
    for i, L in enumerate(lengths):
        blocks = schedule.blocks_attended(int(L))
        nb = -(-int(L) // 16)
        tokens = L if blocks is None else (blocks - 1) * 16 + (L - (nb - 1) * 16)
        scoring = 0 if blocks is None else (nb - 3) * shape.kv_heads * (shape.head_dim * 2 + 8)
        per_seq = 2 * L * kv_tok + 34 * (tokens * kv_tok + scoring)
        assert got.bytes[i] == shape.decode_params * 2 + 2 * per_seq
        assert got.attended_tokens[i] == tokens
        assert got.scoring_bytes[i] == 2 * 34 * scoring


def test_matches_kernels_md_expected_speedups_at_32k():
    """shared/reference/kernels.md §7 'ideal' column: all layers sparse, min/max summaries, 4.3 TB/s."""
    spec = RolloutSpec(samples=8, dense_layers=0, landmark="minmax")
    for name, budget, ideal, dense_ms in [("qwen3-1.7b", 2048, 4.64, 7.8), ("qwen3-4b", 2048, 3.63, 10.8),
                                          ("qwen3-8b", 2048, 2.69, 12.5), ("qwen3-4b", 6144, 2.64, 10.8)]:
        model = CostModel(BUILTIN_MODELS[name], HARDWARE["h200-measured"], spec)
        d, s = model.step_costs(None, np.array([32768])), model.step_costs(fixed(budget // 16 - 3), np.array([32768]))
        assert d.bytes[0] / s.bytes[0] == pytest.approx(ideal, rel=0.01)
        assert d.seconds[0] * 1e3 == pytest.approx(dense_ms, rel=0.01)


def test_rollout_invariants():
    shape, hw = BUILTIN_MODELS["qwen3-8b"], HARDWARE["h200"]
    model = CostModel(shape, hw, RolloutSpec(gen_len=20000))
    dense = model.rollout_cost(None)
    speedups = [dense.seconds / model.rollout_cost(fixed(k)).seconds for k in (29, 125, 509, 1021)]
    assert all(a > b for a, b in zip(speedups, speedups[1:])) and speedups[-1] > 1
    assert model.rollout_cost(fixed(2000)).eflops == pytest.approx(dense.eflops)  # budget ≥ context: dense
    all_dense = CostModel(shape, hw, RolloutSpec(gen_len=20000, dense_layers=shape.layers))
    assert all_dense.rollout_cost(fixed(29)).bytes == pytest.approx(dense.bytes)
    s = load_schedule("qwen3-8b-0.86")
    costs = [CostModel(shape, hw, RolloutSpec(gen_len=n)).compare(s) for n in (4000, 16000, 32000)]
    assert all(a.sparse.seconds < b.sparse.seconds and a.dense.seconds < b.dense.seconds for a, b in zip(costs, costs[1:]))
    steps = model.step_costs(fixed(125))
    far = steps.lengths >= 2 * 128 * 16
    assert (steps.bytes[far] < dense.steps.bytes[far]).all()
    with pytest.raises(ValueError, match="dense_layers=37"):
        CostModel(shape, hw, RolloutSpec(dense_layers=37))


def test_sparse_rollout_is_cheaper_for_every_published_schedule():
    for name, schedule in published_schedules().items():
        shape = BUILTIN_MODELS[name.rsplit("-", 1)[0]]
        cmp = CostModel(shape, HARDWARE["h200"], RolloutSpec()).compare(schedule)
        assert cmp.sparse.eflops < cmp.dense.eflops and cmp.speedup_seconds > 1.2, name
        shares = cmp.sparse.by_bin(schedule)
        assert shares.sum() == pytest.approx(cmp.sparse.seconds)


# ---------------------------------------------------------------- optimiser


def test_optimiser_picks_the_cheapest_budget_meeting_target_per_bin():
    table = {0: {32: 0.90, 48: 0.95}, 1: {32: 0.80, 64: 0.87, 128: 0.90}, 2: {32: 0.5, 1024: 0.85}}
    out = optimise_schedule(table, 0.86, name="t")
    s = out.schedule
    assert [s.blocks_for_bin(b) for b in range(3)] == [32, 64, None]
    assert s.topk_blocks[:3] == (29, 61, None) and s.name == "t" and s.version == 1
    assert [(c.reason, c.alpha) for c in out.bins[:3]] == [("measured", 0.90), ("measured", 0.87), ("dense_unmet", None)]
    assert out.unmet_bins == [2]
    assert [c.source_bin for c in out.bins[3:]] == [2] * 17 and s.topk_blocks[3:] == (None,) * 17
    assert SparsitySchedule.from_dict(s.to_dict()) == s


def test_optimiser_missing_bins_nearest_or_dense():
    table = {2: {32: 0.9}, 6: {64: 0.9}}
    near = optimise_schedule(table, 0.86)
    assert [near.schedule.blocks_for_bin(b) for b in range(8)] == [32, 32, 32, 32, 64, 64, 64, 64]
    assert near.bins[4].source_bin == 6 and near.bins[4].reason == "nearest"  # tie between 2 and 6 → longer bin
    assert near.fallback_bins == [b for b in range(20) if b not in (2, 6)]
    dense = optimise_schedule(table, 0.86, missing="dense")
    assert dense.schedule.topk_blocks[:3] == (None, None, 29) and dense.bins[0].reason == "dense_missing"


def test_optimiser_non_monotone_rules_and_tolerance():
    table = {b: {32: 0.87, 48: 0.84, 64: 0.90, 96: 0.91} for b in range(20)}
    cheap, stable = optimise_schedule(table, 0.86), optimise_schedule(table, 0.86, rule="stable")
    assert cheap.schedule.blocks_for_bin(0) == 32 and stable.schedule.blocks_for_bin(0) == 64
    assert cheap.bins[0].monotone is False
    assert optimise_schedule(table, 0.92).unmet_bins == list(range(20))
    assert optimise_schedule(table, 0.92, tolerance=0.015).schedule.blocks_for_bin(0) == 96


def test_optimiser_recovers_a_published_schedule_and_reports_cost_shares():
    published = load_schedule("qwen3-4b-0.86")
    budgets = [32, 48, 64, 80, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024]
    table = {b: {k: (0.87 if k >= published.blocks_for_bin(b) else 0.85) for k in budgets} for b in range(20)}
    model = CostModel(BUILTIN_MODELS["qwen3-4b"], HARDWARE["h200"], RolloutSpec())
    out = optimise_schedule(table, 0.86, template=published, cost_model=model)
    assert out.schedule.topk_blocks == published.topk_blocks and out.schedule.version == published.version + 1
    shares = [c.cost_share for c in out.bins]
    assert sum(shares) == pytest.approx(1.0) and shares[19] == 0.0 and min(shares[:16]) > 0


def test_optimiser_rejects_bad_input():
    with pytest.raises(ValueError, match="target=1.2"):
        optimise_schedule({0: {32: 0.9}}, 1.2)
    with pytest.raises(ValueError, match=r"alpha_tail\[0\] budget 2: must be an integer >= 3"):
        optimise_schedule({0: {2: 0.9}}, 0.86)
    with pytest.raises(ValueError, match=r"alpha_tail\[0\]\[32\]=nan"):
        optimise_schedule({0: {32: float("nan")}}, 0.86)
    with pytest.raises(ValueError, match="bin 20"):
        optimise_schedule({20: {32: 0.9}}, 0.86)
    with pytest.raises(ValueError, match="no measurements"):
        optimise_schedule({0: {}}, 0.86)


def test_alpha_tail_from_histograms():
    import torch

    hists = {}
    for budget, alpha in [(32, 0.80), (64, 0.90)]:
        h = AlphaHistogram.empty()
        h.add(torch.full((100,), alpha), torch.full((100,), 3))
        hists[budget] = h
    table = alpha_tail_from_histograms(hists)
    assert list(table) == [3] and table[3] == {32: pytest.approx(0.80, abs=1e-3), 64: pytest.approx(0.90, abs=1e-3)}
    assert optimise_schedule(table, 0.86).schedule.blocks_for_bin(3) == 64


# ---------------------------------------------------------------- CLI


@pytest.mark.parametrize("name", sorted(published_schedules()))
def test_cli_costs_every_published_schedule_with_its_model(name, capsys):
    model = name.rsplit("-", 1)[0]
    assert main(["cost", "--model", model, "--schedule", name, "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["model"]["name"] == model and rep["schedule"] == name
    assert rep["appf"]["speedup"] >= 1  # dense until K never costs more than dense
    assert rep["sec33"]["speedup"] > 0  # reads the fixed budget from step 1, so < 1 when it is large (4b-0.92)
    assert rep["schedule_aware"]["speedup_seconds"] > 1.2
    assert sum(b["steps"] for b in rep["bins"]) == 32000


def test_cli_table_and_model_path(tiny_qwen3, capsys):
    assert main(["cost", "--model", "qwen3-4b", "--schedule", "qwen3-4b-0.86", "--per-bin"]) == 0
    out = capsys.readouterr().out
    for label in ("Sec. 3.3 paper form", "App. F paper form", "schedule-aware per-step sum", "seconds (roofline)", "share"):
        assert label in out
    assert main(["cost", "--model", str(tiny_qwen3), "--schedule", "qwen3-1.7b-0.86", "--gen-len", "3000",
                 "--hardware", "h100"]) == 0


@pytest.mark.parametrize("argv, message", [
    (["--model", "qwen3-5b"], "unknown model 'qwen3-5b': choose one of qwen3-0.6b, qwen3-1.7b"),
    (["--hardware", "a100"], "unknown hardware 'a100': choose one of h100, h200"),
    (["--schedule", "qwen3-4b-0.99"], "not a published schedule name"),
    (["--samples", "0"], "--samples=0"),
    (["--dense-layers", "99"], "dense_layers=99"),
])
def test_cli_bad_input_is_one_line_error(argv, message, capsys):
    base = {"--model": "qwen3-4b", "--schedule": "qwen3-4b-0.86"}
    base.update(dict(zip(argv[::2], argv[1::2])))
    assert main(["cost", *[x for kv in base.items() for x in kv]]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
