"""`sparrow bench rl-step`: the job it builds validates for both placements, a step's parts add up, merge compares."""

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparrow.bench.rl_step import job_config, merge, reference_rollout, step_row
from sparrow.coordinator.config import build_config
from sparrow.coordinator.step_record import PublishStats, StepTiming


def _args(**over):
    base = dict(shape="qwen3-1.7b", mode="sparse", schedule=None, engine="native", placement="colocated", weights_channel="auto",
                prompts=2, samples=4, prompt_tokens=256, max_tokens=4096, steps=1, device="cpu",
                kv_cache_dtype="auto", micro_batch_tokens=None, run_mode="sync", pool_gpus=0.5, stop_at_eos=False,
                partial_rollout=None, carry="resume", close_after_s=None,
                carry_staleness=None)
    base.update(over)
    return argparse.Namespace(**base)


@pytest.mark.parametrize("placement", ["colocated", "disaggregated"])
@pytest.mark.parametrize("mode", ["dense", "sparse"])
def test_the_job_it_builds_is_a_valid_config(tmp_path, placement, mode):
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    raw = job_config(_args(placement=placement, mode=mode), tmp_path, tmp_path / "p.jsonl", tmp_path / "runs")
    config = build_config(raw, "test")
    assert config.run.placement == placement
    assert config.rollout.schedule == ("dense" if mode == "dense" else "qwen3-1.7b-0.86")
    assert config.rollout.sampling.ignore_eos
    assert config.run.steps == 2, "one step more than timed, so the timed ones never checkpoint"
    blocks_per_sample = raw["rollout"]["native"]["num_kv_blocks"] / 8
    assert blocks_per_sample * 16 >= 256 + 4096, "every sample's KV fits at the full length"


def test_an_async_disaggregated_job_on_two_gpus(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    args = _args(placement="disaggregated", run_mode="async", pool_gpus=1.0, device="cuda")
    config = build_config(job_config(args, tmp_path, tmp_path / "p.jsonl", tmp_path / "runs"), "test")
    assert config.run.mode == "async" and config.run.staleness == 1
    assert config.rollout.pool.gpus == config.trainer.pool.gpus == 1.0


def test_a_vllm_job_takes_the_native_engines_kv_in_bytes_and_sleeps_when_colocated(tmp_path, tiny_qwen3):
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    raw = job_config(_args(engine="vllm", device="cuda"), tiny_qwen3, tmp_path / "p.jsonl", tmp_path / "runs")
    config = build_config(raw, "test")
    vllm = config.rollout.vllm
    assert config.rollout.engine == "vllm" and vllm.sleep_mode and vllm.max_num_seqs == 2 * 4
    blocks = 2 * 4 * (-(-(256 + 4096 + 64) // 16) + 2)
    # tiny Qwen3: 4 layers x K and V x 2 KV heads x 16 tokens x 32 dims in bf16, and a bf16 landmark per sparse layer
    per_block = 4 * 2 * 2 * 16 * 32 * 2 + 2 * (4 - 2) * 32 * 2
    assert vllm.kv_cache_memory_bytes == blocks * per_block
    assert vllm.engine_args == {"gpu_memory_utilization": 0.45}, "vLLM's start-up check: its half of the GPU"
    apart = build_config(job_config(_args(engine="vllm", device="cpu", placement="disaggregated"), tiny_qwen3,
                                    tmp_path / "p.jsonl", tmp_path / "runs"), "test")
    assert not apart.rollout.vllm.sleep_mode and apart.rollout.vllm.engine_args == {}
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8_e4m3 with --engine vllm"):
        job_config(_args(engine="vllm", kv_cache_dtype="fp8_e4m3"), tiny_qwen3, tmp_path / "p.jsonl", tmp_path / "runs")


def test_variable_lengths_and_partial_rollouts_keep_every_group_in_flight_in_the_batch(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    raw = job_config(_args(stop_at_eos=True, partial_rollout=2), tmp_path, tmp_path / "p.jsonl", tmp_path / "runs")
    config = build_config(raw, "test")
    assert not config.rollout.sampling.ignore_eos
    assert config.run.partial_rollout.enabled and config.run.partial_rollout.extra_groups == 2
    assert config.rollout.native.max_num_seqs == (2 + 2) * 4, "the spare groups decode beside the step's"
    assert not build_config(job_config(_args(), tmp_path, tmp_path / "p.jsonl", tmp_path / "runs"), "t").run.partial_rollout.enabled


def test_a_time_budget_sizes_the_engine_for_the_groups_it_may_carry_and_needs_partial_rollouts(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    raw = job_config(_args(stop_at_eos=True, partial_rollout=0, close_after_s=10.0), tmp_path, tmp_path / "p.jsonl",
                     tmp_path / "runs")
    config = build_config(raw, "t")
    assert config.run.partial_rollout.close_after_s == 10.0 and config.run.budget_carry == 2
    assert config.rollout.native.max_num_seqs == (2 + 0 + 2) * 4, "a step's groups beside the most it may carry"
    with pytest.raises(ValueError, match="--close-after-s 10.0 needs --partial-rollout"):
        job_config(_args(close_after_s=10.0), tmp_path, tmp_path / "p.jsonl", tmp_path / "runs")
    bound = build_config(job_config(_args(partial_rollout=6, close_after_s=10.0, carry_staleness=3), tmp_path,
                                    tmp_path / "p.jsonl", tmp_path / "runs"), "t")
    assert bound.run.carry_staleness == 3 and bound.rollout.native.max_num_seqs == (2 + 6 + 2) * 4
    with pytest.raises(ValueError, match="--carry-staleness 3 needs --partial-rollout"):
        job_config(_args(carry_staleness=3), tmp_path, tmp_path / "p.jsonl", tmp_path / "runs")


def test_no_spare_groups_in_an_async_job_is_a_valid_partial_rollout_config(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    raw = job_config(_args(stop_at_eos=True, partial_rollout=0, run_mode="async", placement="disaggregated"), tmp_path,
                     tmp_path / "p.jsonl", tmp_path / "runs")
    config = build_config(raw, "t")
    assert config.run.partial_rollout.enabled and config.run.partial_rollout.extra_groups == 0


def _record(rollout_wait, train, publish, to_train, to_rollout, update, recompute=None):
    timing = StepTiming(rollout_wait=rollout_wait, collect=0.1, train=train, publish=publish, control=0.0,
                        step=0.0, elapsed=0.0, to_train=to_train, to_rollout=to_rollout)
    rollout = SimpleNamespace(samples=8, tokens=8192, tokens_per_s=100.0, kv_read_fraction=0.25,
                              prompt_length_mean=256.0, response_length_mean=1024.0, response_length_max=4096,
                              tail_share=0.4, busy_batch_fraction=0.5, peak_batch=8, carried_out=0, resumed_samples=0,
                              stale_tokens=0, staleness_histogram={"0": 8})
    train_metrics = {"train/seconds": update, **({} if recompute is None else {"recompute/seconds": recompute})}
    return SimpleNamespace(step=3, timing=timing, train=train_metrics, rollout=rollout,
                           publish=PublishStats(version=4, seconds=publish, send_seconds=publish, bytes=2 * 10**9,
                                                channel="shared", waited=False))


def test_a_steps_idle_time_is_its_wall_time_outside_every_timed_part():
    row = step_row(_record(rollout_wait=60.0, train=20.0, publish=0.5, to_train=1.0, to_rollout=3.0, update=15.0,
                           recompute=4.0), wall=90.0, busy=0.7)
    assert row["idle_s"] == pytest.approx(90.0 - 60.0 - 20.0 - 0.5 - 1.0 - 3.0)
    assert row["train_other_s"] == pytest.approx(1.0)
    assert row["publish_fraction"] == pytest.approx(0.5 / 90.0)
    assert row["publish_gb"] == 2.0 and row["gpu_busy"] == 0.7


def test_an_on_policy_update_has_no_recompute():
    row = step_row(_record(10.0, 5.0, 0.1, 0.0, 0.0, update=5.0), wall=16.0, busy=None)
    assert row["recompute_s"] is None and row["train_other_s"] == 0.0


def _result(mode, walls, rollouts, placement="colocated", max_tokens=32768, tokens=None):
    tokens = tokens or [8 * max_tokens] * len(walls)
    steps = [{"wall_s": w, "rollout_s": r, "recompute_s": None, "update_s": 10.0, "publish_s": 0.1, "to_train_s": 0.2,
              "to_rollout_s": 2.0, "idle_s": 0.1, "publish_fraction": 0.1 / w, "idle_fraction": 0.1 / w,
              "gpu_busy": None, "tokens": t} for w, r, t in zip(walls, rollouts, tokens)]
    return {"kind": "rl-step", "shape": "qwen3-1.7b", "prompts": 1, "samples": 8, "max_tokens": max_tokens,
            "mode": mode, "placement": placement, "steps": steps}


def test_merge_gives_each_placements_step_and_rollout_speedup_from_the_steps_after_the_warm_up():
    merged = merge([_result("dense", [400.0, 200.0, 220.0], [300.0, 180.0, 200.0]),
                    _result("sparse", [150.0, 100.0, 110.0], [120.0, 80.0, 90.0]),
                    _result("dense", [300.0], [280.0], placement="disaggregated"),
                    {**_result("sparse", [90.0], [70.0], placement="disaggregated"), "run_mode": "async"}])
    assert merged["speedups"] == {"colocated": {"step": pytest.approx(2.0), "rollout": pytest.approx(190.0 / 85.0),
                                                "step_per_token": pytest.approx(2.0)}}, (
        "step 0 left out; a sync dense run is not paired with an async sparse one")
    dense = next(r for r in merged["rows"] if r["mode"] == "dense" and r["placement"] == "colocated")
    assert dense["steps"] == 2 and dense["warmup_excluded"] and dense["wall_s"] == 210.0 and dense["recompute_s"] is None
    single = next(r for r in merged["rows"] if r["placement"] == "disaggregated")
    assert single["steps"] == 1 and not single["warmup_excluded"] and single["wall_s"] == 300.0, "one step: it is kept"
    partial = merge([_result("dense", [100.0], [90.0]), {**_result("sparse", [50.0], [40.0]), "partial_rollout": 2,
                                                         "carry": "resume"}])
    assert partial["speedups"] == {}, "partial rollouts are paired with partial rollouts only"
    fp8 = merge([_result("dense", [100.0], [90.0]), {**_result("sparse", [50.0], [40.0]), "kv_cache_dtype": "fp8_e4m3"}])
    assert fp8["speedups"] == {}, "FP8 pages are paired with FP8 pages only"
    assert {r["placement"] for r in fp8["rows"]} == {"colocated", "colocated fp8_e4m3 pages"}
    assert {r["placement"] for r in partial["rows"]} == {"colocated", "colocated partial+2 resume"}


def test_with_lengths_ending_at_eos_the_speedup_per_trained_token_corrects_for_the_tokens_each_run_drew():
    """Sparse drew twice the tokens: the same step time is 2x faster per token."""
    merged = merge([_result("dense", [1.0, 40.0], [1.0, 30.0], tokens=[1, 50_000]),
                    _result("sparse", [1.0, 40.0], [1.0, 30.0], tokens=[1, 100_000])])
    speedup = merged["speedups"]["colocated"]
    assert speedup["step"] == pytest.approx(1.0) and speedup["step_per_token"] == pytest.approx(2.0)
    assert merged["rows"][0]["wall_s_per_1k_tokens"] == pytest.approx(0.8)


def test_merge_gives_the_runs_rollout_tokens_per_second_and_peak_batch_for_bench_rollout_to_be_set_beside():
    """Tokens over rollout seconds summed over the steady steps (a step that waited 0 s for carried groups still
    counts its tokens), and the largest batch any step reached."""
    result = _result("dense", [50.0, 40.0, 10.0], [45.0, 30.0, 0.0], tokens=[1, 60_000, 30_000])
    for step, peak in zip(result["steps"], (40, 32, None)):
        step["peak_batch"] = peak
    (row,) = merge([result])["rows"]
    assert row["run_tokens_per_s"] == pytest.approx(90_000 / 30.0) and row["peak_batch"] == 32
    (old,) = merge([_result("dense", [50.0], [45.0])])["rows"]
    assert old["peak_batch"] is None, "results recorded before peak_batch was kept"


def test_the_reference_rollout_decodes_the_runs_peak_batch_at_its_mean_length_with_the_jobs_engine(tmp_path, tiny_qwen3,
                                                                                                   capsys):
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n')
    args = _args(mode="sparse", schedule="qwen3-1.7b-0.86", max_tokens=64, prompt_tokens=32)
    config = build_config(job_config(args, tiny_qwen3, tmp_path / "p.jsonl", tmp_path / "runs"), "test")
    rows = [{"peak_batch": 8, "response_tokens_mean": 60.0}, {"peak_batch": 7, "response_tokens_mean": 30.0},
            {"peak_batch": 3, "response_tokens_mean": 20.0}]
    reference = reference_rollout(config, tiny_qwen3, rows, samples=4, prompt_tokens=32)
    assert reference["batch"] == 8 and reference["gen_len"] == 25, "steady steps: peak 7 -> 2 groups of 4, mean 25"
    assert reference["tokens_generated"] == 8 * 25 and not reference["truncated"] and reference["errors"] == 0
    unreported = reference_rollout(config, tiny_qwen3, [{"peak_batch": None, "samples": 4, "response_tokens_mean": 9.0}],
                                   4, 32)
    assert unreported["batch"] == 4 and unreported["gen_len"] == 9, "no batch report: the samples the step trained"
    with pytest.raises(ValueError, match="no peak batch"):
        reference_rollout(config, tiny_qwen3, [{"peak_batch": None, "response_tokens_mean": 1.0}], 4, 32)
    result = {**_result("sparse", [1.0, 40.0], [1.0, 30.0], tokens=[1, 60_000]),
              "reference_rollout": {**reference, "total_tok_s": 4000.0}}
    (row,) = merge([result])["rows"]
    assert row["reference_tokens_per_s"] == 4000.0 and row["run_tokens_per_s"] == pytest.approx(2000.0)


def test_merge_refuses_results_of_different_protocols_or_kinds():
    with pytest.raises(ValueError, match="different protocols"):
        merge([_result("dense", [1.0], [1.0]), _result("sparse", [1.0], [1.0], max_tokens=8192)])
    with pytest.raises(ValueError, match="not a `bench rl-step` result"):
        merge([{"kind": "rollout"}])


def test_the_bench_runs_the_real_job_on_cpu_and_keeps_each_step_and_the_reference(tmp_path, capsys):
    """The whole command on the tiny shape: the JSON holds every step and the no-tail reference, and the merge sets
    the job's rollout tokens/s beside it; sparse without --schedule on a shape with no published one is refused."""
    from sparrow.cli.main import main

    out = tmp_path / "run.json"
    assert main(["bench", "rl-step", "--shape", "tiny", "--device", "cpu", "--mode", "sparse", "--workdir",
                 str(tmp_path / "w")]) == 2  # no published tiny-0.86: refused before any checkpoint is built
    assert "give --schedule" in capsys.readouterr().err and not (tmp_path / "w").exists()
    assert main(["bench", "rl-step", "--shape", "tiny", "--device", "cpu", "--mode", "dense", "--max-tokens", "16",
                 "--prompt-tokens", "32", "--workdir", str(tmp_path / "w"),
                 "--set", "rollout.native.max_num_seqs=0"]) == 2
    refusal = capsys.readouterr().err
    assert "bench rl-step with --set overrides" in refusal and "max_num_seqs" in refusal
    assert main(["bench", "rl-step", "--shape", "tiny", "--device", "cpu", "--mode", "sparse", "--schedule",
                 "qwen3-1.7b-0.86", "--prompts", "1", "--samples", "2", "--max-tokens", "16", "--prompt-tokens", "32",
                 "--steps", "2", "--workdir", str(tmp_path / "w"), "--out", str(out), "--reference-rollout",
                 "--set", "trainer.optimizer.lr=2.5e-6"]) == 0
    result = json.loads(out.read_text())
    assert result["set"] == ["trainer.optimizer.lr=2.5e-6"]
    pools = result["pools_startup"]  # colocated: the engine starts once the rank has offloaded its states
    assert pools["together"] is False and 0 < pools["trainer_ranks_seconds"] < pools["seconds"] < result["startup_s"]
    assert "lr: 2.5e-06" in (Path(result["run_dir"]) / "config.yaml").read_text()
    assert [s["step"] for s in result["steps"]] == [0, 1] and result["steps_asked"] == 2
    assert all(s["samples"] == 2 and s["tokens"] == 2 * 16 for s in result["steps"])
    (engine,) = result["engine_stats"]  # the engine's own counters, read after the timed steps
    assert engine["schedule"] == "qwen3-1.7b-0.86" and engine["tokens_generated"] == 2 * 2 * 16
    reference = result["reference_rollout"]
    assert reference["batch"] == 2 and reference["gen_len"] == 16 and reference["tokens_generated"] == 32
    capsys.readouterr()
    assert main(["bench", "rl-step-merge", str(out)]) == 0
    assert "colocated sparse: the rollout ran at " in capsys.readouterr().out
