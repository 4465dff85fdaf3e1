"""`sparrow calibrate`: pure parts (binning, budgets, α per token, table, optimisation) and one real
run on the tiny Qwen3 whose outputs the controller's warm start and `load_schedule` accept."""

import json

import pytest
import torch

from sparrow.acceptance import AlphaHistogram
from sparrow.cli.main import main
from sparrow.coordinator.calibration import (
    BudgetRun, CalibrationConfig, alpha_table, assemble, bin_edges, calibration_template, default_budgets,
    fixed_budget_schedule, measurement_file, sample_alpha, sparse_token_mask, token_length_bins,
)
from sparrow.coordinator.calibration.measure import SampleAlpha
from sparrow.coordinator.calibration.runner import load_prompts, make_plan
from sparrow.coordinator.controller import ControllerConfig, initial_schedule
from sparrow.schedule import SPARROW_EDGES, load_schedule

# ------------------------------------------------------------------ plan: bins and budgets


@pytest.mark.parametrize("edges", [SPARROW_EDGES, (128, 256, 384), (136, 168, 200), (40, 41, 100)])
@pytest.mark.parametrize("prompt_len", [1, 15, 16, 17, 100, 1990])
def test_token_length_bins_are_bin_of_prompt_plus_t(edges, prompt_len):
    template = calibration_template(edges)
    bins = token_length_bins(template, prompt_len, 300)
    assert bins.tolist() == [template.bin_of(prompt_len + t) for t in range(300)]


def test_bin_edges_and_default_budgets():
    assert bin_edges(128, 305) == [128, 256]
    assert bin_edges(128, 128) == []
    assert default_budgets(305, reserved=3) == [4, 8, 16]  # 20 blocks: 24 and up would be dense everywhere
    assert default_budgets(40_000, reserved=3)[-1] == 1024 and 32 in default_budgets(40_000, reserved=3)
    assert default_budgets(48, reserved=3) == []


def test_plan_without_a_sparse_budget_explains_the_fix():
    with pytest.raises(ValueError, match="raise --max-tokens or give --budgets"):
        make_plan(CalibrationConfig(max_tokens=8), [30])
    plan = make_plan(CalibrationConfig(max_tokens=100, budgets=[4, 64]), [30])
    assert plan.template.edges == SPARROW_EDGES
    assert any("cover the longest context" in n for n in plan.notes)
    assert any("--bin-width" in n for n in plan.notes)  # everything in Sparrow's first bin
    assert make_plan(CalibrationConfig(max_tokens=300, bin_width=128), [50]).template.edges == (128, 256)


def test_fixed_budget_schedule_attends_the_budget_in_every_bin():
    template = calibration_template((128, 256))
    s = fixed_budget_schedule(template, 6)
    assert [s.blocks_for_bin(b) for b in range(s.num_bins)] == [6, 6, 6]
    assert s.blocks_attended(6 * 16) is None and s.blocks_attended(6 * 16 + 1) == 6
    with pytest.raises(ValueError, match="sink"):
        fixed_budget_schedule(template, 2)


def test_sparse_token_mask_marks_passes_below_their_context():
    # prompt 30 → token t decoded at L = 30 + t, ceil(L/16) blocks; a budget of 3 bites from L = 49
    blocks = torch.tensor([min(-(-(30 + t) // 16), 3) for t in range(30)])
    mask = sparse_token_mask(blocks, 30)
    assert mask.tolist() == [30 + t > 48 for t in range(30)]


# ------------------------------------------------------------------ α per token


def test_sample_alpha_is_exact_and_inside_the_topk_interval():
    torch.manual_seed(0)
    logp = torch.log_softmax(torch.randn(12, 50) * 2, -1)
    logq = torch.log_softmax(logp + 0.7 * torch.randn(12, 50), -1)
    top = logq.topk(5, dim=-1)
    alpha = sample_alpha(logp, logq, top.indices, top.values)
    assert torch.allclose(alpha.exact, torch.minimum(logp.exp(), logq.exp()).sum(-1), atol=1e-6)
    assert (alpha.lower <= alpha.exact + 1e-6).all() and (alpha.exact <= alpha.upper + 1e-6).all()
    assert (alpha.exact < 0.99).any()
    same = sample_alpha(logp, logp, top.indices, top.values)
    assert torch.allclose(same.exact, torch.ones(12), atol=1e-6)


@pytest.mark.parametrize("prompt_len", [1, 37, 80])
def test_prompt_recompute_equals_the_whole_sequence_recompute(tiny_qwen3, prompt_len):
    """Encoding the prompt once and running only the generated positions gives the numbers of
    `teacher_forced_logprobs` over the whole sequence, dense and with replayed sparse budgets."""
    from sparrow.rollout_workers.native import PromptRecompute
    from sparrow.kernels import SparseAttentionConfig
    from sparrow.rollout_workers.native import load_model, teacher_forced_logprobs

    torch.manual_seed(0)
    model = load_model(tiny_qwen3)
    attention = SparseAttentionConfig(dense_layers=(0,))
    generated = 70
    tokens = torch.randint(0, model.spec.vocab_size, (prompt_len + generated,))
    blocks = torch.tensor([min(-(-(prompt_len + t) // 16), 4) for t in range(generated)])
    recompute = PromptRecompute(model, tokens[:prompt_len], attention, temperature=0.7)
    for replay in (None, blocks):
        ours = recompute.logprobs(tokens[prompt_len:], replay)
        ref = teacher_forced_logprobs(model, tokens, prompt_len, attention=attention, temperature=0.7, full=True,
                                      blocks_attended=replay)
        assert torch.allclose(ours.full_logprobs, ref.full_logprobs, atol=2e-5)
        assert torch.equal(ours.logprobs, ours.full_logprobs.gather(-1, tokens[prompt_len:, None])[:, 0])
        assert torch.equal(ours.blocks_attended.cpu(), ref.blocks_attended.cpu())
    assert (blocks < -(-(prompt_len + torch.arange(generated)) // 16)).any()  # the replayed budgets bite


# ------------------------------------------------------------------ table and optimisation


def synthetic_runs(template, counts=400) -> dict:
    """α falling with length and rising with budget: bin b at budget k is uniform on [1 − 2d, 1], d = 0.16·2^b/k."""
    gen = torch.Generator().manual_seed(0)
    runs = {}
    for budget in (None, 4, 8, 16):
        run = BudgetRun(budget, template.num_bins)
        for b in range(template.num_bins - 1):  # the last bin is never reached
            n = 20 if (b == 0 and budget == 8) else counts
            drop = 0.0 if budget is None else 0.16 * 2**b / budget
            alpha = (1.0 - drop * torch.rand(n, generator=gen) * 2).clamp(0, 1)
            a = SampleAlpha(alpha, alpha - 0.1, alpha)
            run.add_sample(a, torch.full((n,), b), torch.ones(n, dtype=torch.bool), torch.zeros(n), 0)
        runs[budget] = run
    return runs


def test_table_marks_the_choice_and_matches_the_controller_warm_start(tmp_path):
    template = calibration_template((128, 256, 384))
    result = assemble(template, synthetic_runs(template), target=0.86, percentile=5, min_tokens=100)
    topk = list(result.schedule.topk_blocks)
    # bin 0: 4 blocks reach τ; bin 1 needs 8; bin 2 needs 16; bin 3 unmeasured copies bin 2
    assert [None if v is None else v + 3 for v in topk] == [4, 8, 16, 16]
    headers, rows = alpha_table(result)
    assert headers[2:5] == ["4 blocks p5", "8 blocks p5", "16 blocks p5"] and headers[5] == "dense p5"
    assert rows[0][2].split(" ")[0].endswith("*") and rows[1][3].split(" ")[0].endswith("*")
    assert "?" in rows[0][3] and "(20)" in rows[0][3]  # 20 tokens < min_tokens
    assert rows[3][2:6] == ["-"] * 4 and rows[3][-1] == "nearest (bin 2)"
    assert any("bin 3 was not reached" in w for w in result.warnings())

    path = tmp_path / "measurements.json"
    path.write_text(json.dumps(measurement_file(result, {})))
    # the warm start reads the histograms of the controller's own statistic (upper = exact α here)
    controlled = initial_schedule(ControllerConfig(target=0.86, calibration=str(path), statistic="upper"), template)
    assert controlled.topk_blocks == result.schedule.topk_blocks
    on_lower = assemble(template, synthetic_runs(template), target=0.86, percentile=5, min_tokens=100, statistic="lower")
    controlled = initial_schedule(ControllerConfig(target=0.86, calibration=str(path)), template)
    assert controlled.topk_blocks == on_lower.schedule.topk_blocks != result.schedule.topk_blocks
    with pytest.raises(ValueError, match="rollout.schedule"):  # Sparrow's 2000-token bins ≠ the measured ones
        initial_schedule(ControllerConfig(target=0.86, calibration=str(path)))


def test_the_schedule_can_be_chosen_on_the_topk_lower_bound(tmp_path):
    template = calibration_template((128, 256, 384))
    runs = synthetic_runs(template)
    exact = assemble(template, runs, target=0.86, percentile=5)
    lower = assemble(template, runs, target=0.86, percentile=5, statistic="lower")  # lower = exact − 0.1 here
    assert lower.cell(0, 16).tail == pytest.approx(exact.cell(0, 16).tail - 0.1, abs=2e-3)
    assert [v is None or v >= (w or 0) for v, w in zip(lower.schedule.topk_blocks, exact.schedule.topk_blocks)] == [True] * 4
    assert lower.schedule.topk_blocks != exact.schedule.topk_blocks
    data = measurement_file(lower, {})
    assert data["statistic"] == "lower" and data["histograms"]["4"] == runs[4].lower.to_dict()


def test_a_bin_no_budget_rescues_stays_dense_with_a_warning():
    template = calibration_template((128, 256, 384))
    result = assemble(template, synthetic_runs(template), target=0.97, percentile=5)
    assert result.schedule.topk_blocks[2] is None
    assert any("bin 2: no profiled budget reaches" in w for w in result.warnings())


def test_a_topk_lower_bound_below_tau_even_when_dense_is_flagged():
    template = calibration_template((128, 256, 384))
    runs = synthetic_runs(template)  # dense: exact α = 1, top-K lower bound = 0.9
    assert not any("top-K lower bound" in w for w in assemble(template, runs, target=0.86, percentile=5).warnings())
    warnings = assemble(template, runs, target=0.95, percentile=5).warnings()
    assert any("dense rollout's p5 of the top-K lower bound is 0.900 < τ=0.95" in w for w in warnings)



def test_a_replay_difference_names_its_cause():
    """Off tokens with the same blocks attended are rounding (bf16 on a GPU: most tokens), not a different selection."""
    template = calibration_template((128, 256, 384))
    runs = synthetic_runs(template)
    run = runs[8]
    run.tokens, run.replay_tokens_off = 1000, 900
    [line] = [w for w in assemble(template, runs, target=0.86, percentile=5).warnings() if "Δlog q" in w]
    assert "900 of 1000 tokens" in line and "the same blocks attended: numeric differences" in line
    run.replay_block_mismatches = 12
    [line] = [w for w in assemble(template, runs, target=0.86, percentile=5).warnings() if "Δlog q" in w]
    assert "other blocks chosen on near-tied scores" in line

# ------------------------------------------------------------------ configuration and CLI errors


@pytest.mark.parametrize("kwargs, message", [
    ({"percentile": 60}, "less than or equal to 50"),
    ({"budgets": [2, 8]}, "must be >= 3"),
    ({"budgets": [8, 8]}, "each budget once"),
    ({"edges": [128], "bin_width": 128}, "either edges or bin_width"),
    ({"edges": [256, 128]}, "increasing"),
    ({"prompts": "data.csv"}, ".jsonl"),
    ({"hardware": "tpu"}, "h200"),
    ({"prompts": "needle", "task": {"context_lines": [30, 20]}}, "context_lines"),
    ({"prompts": "needle", "task": {"context_line": [3, 5]}}, "task knob context_line: Extra inputs"),
    ({"prompts": "data.jsonl", "task": {"needles": 2}}, "apply to a built-in task"),
    ({"landmark": "int8"}, "mean_int8"),
])
def test_config_rejects_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CalibrationConfig(**kwargs)


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert main(["calibrate", "--percentile", "70", "--out", str(tmp_path)]) == 2
    assert "--percentile" in capsys.readouterr().err
    assert main(["calibrate", "--model", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "not a Hugging Face model directory" in capsys.readouterr().err


def test_jsonl_prompts_need_no_answer_column(tiny_qwen3, tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"Tell a story about the number {i}."}) for i in range(3)))
    notes = []
    ids = load_prompts(CalibrationConfig(prompts=str(path), num_prompts=5), AutoTokenizer.from_pretrained(tiny_qwen3),
                       notes.append)
    assert len(ids) == 3 and all(len(x) > 5 for x in ids) and "using all of them" in notes[0]


def test_task_prompts_use_the_tasks_knobs(tiny_qwen3):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    lengths = {}
    for lines in ([4, 4], [40, 40]):
        config = CalibrationConfig(prompts="needle", task={"context_lines": lines, "needles": 2}, num_prompts=3)
        lengths[lines[0]] = [len(x) for x in load_prompts(config, tokenizer, print)]
    assert min(lengths[40]) > max(lengths[4]) + 300, lengths  # 36 more context lines of ~10+ tokens each


def test_calibrate_on_the_needle_task(tiny_qwen3, tmp_path):
    out = tmp_path / "needle"
    code = main([
        "calibrate", "--model", str(tiny_qwen3), "--prompts", "needle", "--task", "context_lines=[6,10]",
        "--task", "needles=2", "--num-prompts", "2", "--samples", "1", "--max-tokens", "8", "--ignore-eos",
        "--budgets", "4,64", "--bin-width", "64", "--threads", "1", "--out", str(out), "--no-progress",
        "--landmark", "mean_int8",
    ])
    assert code == 0
    data = json.loads((out / "measurements.json").read_text())
    assert data["meta"]["landmark"] == "mean_int8" and data["runs"]["4"]["replay_block_mismatches"] == 0
    assert data["runs"]["4"]["tokens"] == 2 * 1 * 8
    assert load_schedule(out / "schedule.json").edges[0] == 64
    assert "prompts needle {'context_lines': [6, 10], 'needles': 2}" in load_schedule(out / "schedule.json").notes[0]


def test_bad_task_knob_is_one_cli_line(tmp_path, capsys):
    assert main(["calibrate", "--prompts", "needle", "--task", "context_lines", "--out", str(tmp_path)]) == 2
    assert "--task 'context_lines': expected KEY=VALUE" in capsys.readouterr().err
    assert main(["calibrate", "--prompts", "needle", "--task", "hops=2", "--out", str(tmp_path)]) == 2
    assert "--task: task knob hops: Extra inputs are not permitted" in capsys.readouterr().err


# ------------------------------------------------------------------ a real run on the tiny model

PROMPTS, SAMPLES, MAX_TOKENS = 2, 2, 64


@pytest.fixture(scope="module")
def calibrated(tiny_qwen3, tmp_path_factory):
    out = tmp_path_factory.mktemp("calibration")
    code = main([
        "calibrate", "--model", str(tiny_qwen3), "--num-prompts", str(PROMPTS), "--samples", str(SAMPLES),
        "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--budgets", "4,5,64", "--bin-width", "32",
        "--min-tokens", "50", "--threads", "1", "--out", str(out), "--no-progress",
    ])
    assert code == 0
    return out


def test_calibration_writes_a_schedule_the_job_and_controller_accept(calibrated):
    schedule = load_schedule(calibrated / "schedule.json")
    data = json.loads((calibrated / "measurements.json").read_text())
    assert list(schedule.edges) == data["edges"] and schedule.edges[0] == 32
    assert all(v is None or v + 3 in (4, 5, 64) for v in schedule.topk_blocks)
    # the controller (on the top-K lower bound, α's guaranteed floor) warm-starts at least as dense per bin
    controlled = initial_schedule(ControllerConfig(target=0.86, calibration=str(calibrated / "measurements.json")), schedule)
    dense = 10**9
    assert all((c if c is not None else dense) >= (e if e is not None else dense)
               for c, e in zip(controlled.topk_blocks, schedule.topk_blocks))
    for row in data["tail_table"]:  # the plot puts each bin at the mean length of its tokens
        assert row["min_length"] <= row["mean_length"] <= (row["max_length"] or 10**9)
    png = (calibrated / "alpha_vs_length.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    report = (calibrated / "report.md").read_text()
    assert "| bin | length (tokens) | 4 blocks p5 |" in report and "controller:" in report


def test_every_generated_token_is_counted_once_per_budget(calibrated):
    data = json.loads((calibrated / "measurements.json").read_text())
    expected = PROMPTS * SAMPLES * MAX_TOKENS  # --ignore-eos: every sample runs to max_tokens
    for label in ("4", "5", "64"):
        hist = AlphaHistogram.from_dict(data["histograms"][label])
        assert int(hist.count().sum()) == expected == data["runs"][label]["tokens"]
        assert data["runs"][label]["replay_block_mismatches"] == 0
        assert data["runs"][label]["replay_max_error"] < 1e-4  # the sparse recompute replays the engine
        assert data["runs"][label]["replay_tokens_off"] == 0
    assert int(AlphaHistogram.from_dict(data["dense_baseline"]).count().sum()) == expected


def test_a_budget_covering_the_context_is_the_dense_floor(calibrated):
    data = json.loads((calibrated / "measurements.json").read_text())
    for hist in (AlphaHistogram.from_dict(data["histograms"]["64"]), AlphaHistogram.from_dict(data["dense_baseline"])):
        assert int(hist.counts[:, :-1].sum()) == 0  # every token in the top cell: α ≥ 0.9995
        assert float(hist.mean()[hist.count() > 0].min()) > 1 - 1e-5
    sparse = AlphaHistogram.from_dict(data["histograms"]["4"])
    assert data["runs"]["4"]["sparse_tokens"] > 0 and int(sparse.counts[:, :-1].sum()) > 0  # the budget bites
