"""Bad requests fail alone with a clear message; the CLIs run end to end on the tiny model."""

import json
import re
from pathlib import Path

import pytest
import torch

from sparrow.cli.main import main
from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine, NativeEngineConfig
from sparrow.schedule import ScheduleError, SparsitySchedule


def test_bad_requests_fail_alone(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=16, max_model_len=256, max_num_seqs=4)
    good = RolloutRequest("good", tuple(range(5, 30)), SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    bad = {
        "long": (RolloutRequest("long", tuple([7] * 256)), "the prompt has 256 tokens but max_model_len is 256"),
        "temp": (RolloutRequest("temp", (5, 6), SamplingParams(temperature=-1.0)), "temperature=-1.0"),
        "top_p": (RolloutRequest("top_p", (5, 6), SamplingParams(top_p=0.0)), "top_p=0.0"),
        "vocab": (RolloutRequest("vocab", (5, 99999)), r"token ids \[99999\] are outside the vocabulary"),
        "empty": (RolloutRequest("empty", ()), "prompt_token_ids is empty"),
        "n": (RolloutRequest("n", (5, 6), SamplingParams(n=5)), "n=5 exceeds max_num_seqs=4"),
        "pool": (RolloutRequest("pool", tuple([7] * 250), SamplingParams(n=4)), "the prompt needs 19 KV blocks but the pool has 16"),
    }
    samples = engine.generate([good] + [r for r, _ in bad.values()])
    assert samples[0].request_id == "good" and samples[0].finish_reason == "length" and len(samples[0].token_ids) == 8
    errors = {s.request_id: s for s in samples[1:]}
    for name, (_, message) in bad.items():
        assert errors[name].finish_reason == "error"
        assert errors[name].token_ids.numel() == 0
        assert re.search(message, errors[name].error), (name, errors[name].error)
    assert sum(s.request_id == "n" for s in samples) == 5  # one error sample per requested sample
    assert engine.stats()["samples_failed"] == 5 + 5 + 4


def test_a_kv_pool_the_device_cannot_hold_names_num_kv_blocks_and_the_fixes(tiny_qwen3, monkeypatch):
    """The allocator's own out-of-memory error (what a GPU raises; a CPU pool is not touched until used) becomes one
    that says which setting asked for how much."""
    from sparrow.rollout_workers.native import model_runner

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 58.41 GiB.")

    monkeypatch.setattr(model_runner, "KVCache", no_room)
    with pytest.raises(MemoryError, match=r"num_kv_blocks=4096: the KV pool needs 0\.1 GiB, more than cpu has free "
                                          r"\(.*\); lower num_kv_blocks .*kv_cache_dtype='fp8_e4m3'"):
        NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=4096)


def test_sequence_reaching_max_model_len_stops_with_length(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=32, max_model_len=40)
    sample = engine.generate([RolloutRequest("x", tuple(range(5, 35)), SamplingParams(max_tokens=100, ignore_eos=True))])[0]
    assert sample.finish_reason == "length" and len(sample.token_ids) == 10


def test_a_sequence_bigger_than_the_pool_errors_without_stalling_others(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=6)
    big = RolloutRequest("big", tuple(range(5, 70)), SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    small = RolloutRequest("small", tuple(range(5, 10)), SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    out = {s.request_id: s for s in engine.generate([big, small])}
    assert out["small"].finish_reason == "length"
    assert out["big"].finish_reason == "error" and "raise num_kv_blocks" in out["big"].error
    assert engine.scheduler.blocks.num_used == 0


def test_config_and_schedule_errors_name_the_field(tiny_qwen3):
    with pytest.raises(ValueError, match="dense_layers"):
        NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=8, dense_layers=(0, 9))
    with pytest.raises(ValueError, match="device"):
        NativeEngineConfig(device="tpu")
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        NativeEngineConfig(prefill_chunk_size=0)
    with pytest.raises(ValueError, match="extra"):
        NativeEngineConfig(max_seqs=3)
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=8)
    with pytest.raises(ScheduleError, match="recent=1 but the engine uses recent=2"):
        engine.set_schedule(SparsitySchedule(name="r1", topk_blocks=(4,), edges=(), recent=1))


def test_generate_cli_json(tiny_qwen3, capsys):
    code = main(["generate", "--model", str(tiny_qwen3), "--prompt", "def main():", "--max-tokens", "6", "--temperature", "0",
                 "--n", "2", "--logprobs", "3", "--schedule", "qwen3-4b-0.86", "--json", "--chat"])
    lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert code == 0 and [line["sample"] for line in lines] == [0, 1]
    first = lines[0]
    assert len(first["tokens"]) == len(first["logprobs"]) == len(first["blocks_attended"]) <= 6
    assert len(first["top_ids"][0]) == 3 and first["finish_reason"] in ("stop", "length") and first["prompt"] == "def main():"
    assert first["tokens"] == lines[1]["tokens"]  # greedy samples agree


def test_generate_cli_reports_bad_input(tiny_qwen3, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "x"}\n{"text": "y"}\n')
    assert main(["generate", "--model", str(tiny_qwen3), "--prompts-file", str(prompts), "--max-tokens", "2"]) == 2
    assert "prompts.jsonl:2" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_qwen3), "--prompt", "x", "--max-tokens", "2", "--top-p", "1.5"]) == 2
    assert "top_p=1.5" in capsys.readouterr().err


def test_bench_rollout_cli(capsys):
    code = main(["bench", "rollout", "--model", "tiny", "--prompt-len", "64", "--gen-len", "8", "--batch", "4",
                 "--samples", "2", "--budget", "3", "--json"])
    result = json.loads(capsys.readouterr().out)
    dense, sparse = result["modes"]["dense"], result["modes"]["sparse"]
    assert code == 0 and dense["errors"] == sparse["errors"] == 0
    assert dense["decode_steps"] == sparse["decode_steps"] == 7 and dense["decode_tokens"] == 4 * 7
    assert sparse["mean_blocks"] < dense["mean_blocks"]
    assert [w["first_context"] for w in dense["step_profile"]] == [65]
    assert torch.isfinite(torch.tensor(result["decode_speedup"]))
    assert result["gpu_memory"] is None  # measured on CUDA only
    assert result["sampler"] == "eager"  # the fused sampler is a CUDA kernel


def test_bench_rollout_one_mode_per_run_then_merge(tmp_path, capsys):
    """Each mode in its own process, same seed: the same requests; the merge refuses mismatched settings."""
    common = ["bench", "rollout", "--model", "tiny", "--prompt-len", "40", "--gen-len", "6", "--batch", "2",
              "--budget", "3"]
    for mode in ("dense", "sparse"):
        assert main([*common, "--mode", mode, "--out", str(tmp_path / f"{mode}.json")]) == 0
    out = capsys.readouterr().out
    assert "sparse / dense" not in out
    assert main(["bench", "rollout-merge", str(tmp_path / "dense.json"), str(tmp_path / "sparse.json"), "--json"]) == 0
    merged = json.loads(capsys.readouterr().out)
    assert set(merged["modes"]) == {"dense", "sparse"} and len(merged["commands"]) == 2
    assert merged["modes"]["dense"]["decode_tokens"] == merged["modes"]["sparse"]["decode_tokens"] == 2 * 5
    assert merged["decode_speedup"] > 0
    for mode, used in (("dense", 120.5), ("sparse", 131.0)):  # as a GPU run reports it: the merge keeps the most held
        report = json.loads((tmp_path / f"{mode}.json").read_text())
        report["gpu_memory"] = {"total_gb": 150.0, "free_after_model_gb": 133.0, "used_gb": used,
                                "peak_reserved_gb": 119.0}
        (tmp_path / f"{mode}-gpu.json").write_text(json.dumps(report))
    assert main(["bench", "rollout-merge", str(tmp_path / "dense-gpu.json"), str(tmp_path / "sparse-gpu.json")]) == 0
    text = capsys.readouterr().out
    assert "GPU memory: 131.0 of 150.0 GB in use with the engine" in text
    assert "last step ms" in text  # the step that hands out the samples: where an end-of-run cost shows
    other = json.loads((tmp_path / "sparse.json").read_text()) | {"gen_len": 7}
    (tmp_path / "other.json").write_text(json.dumps(other))
    assert main(["bench", "rollout-merge", str(tmp_path / "dense.json"), str(tmp_path / "other.json")]) == 2
    assert "gen_len=7" in capsys.readouterr().err
    assert main(["bench", "rollout-merge", str(tmp_path / "dense.json"), str(tmp_path / "dense.json")]) == 2
    assert "mode 'dense' from step 0 is already" in capsys.readouterr().err
    assert main([*common, "--mode", "sparse", "--kv-cache-dtype", "fp8_e4m3", "--out", str(tmp_path / "fp8.json")]) == 0
    assert "FP8 KV pages" in capsys.readouterr().out
    assert json.loads((tmp_path / "fp8.json").read_text())["kv_cache_dtype"] == "fp8_e4m3"
    assert main(["bench", "rollout-merge", str(tmp_path / "dense.json"), str(tmp_path / "fp8.json")]) == 2
    assert "kv_cache_dtype='fp8_e4m3' but" in capsys.readouterr().err
    assert main([*common, "--mode", "sparse", "--landmark", "mean_int8", "--out", str(tmp_path / "int8.json")]) == 0
    assert "int8 landmarks" in capsys.readouterr().out
    assert main(["bench", "rollout-merge", str(tmp_path / "dense.json"), str(tmp_path / "int8.json")]) == 2
    assert "landmark='mean_int8' but" in capsys.readouterr().err


def test_replayed_windows_take_one_path():
    """`--replayed` compares a window's real steps with a replay of one path: a sparse run's first window, where its
    schedule turns sparse at 513 tokens, is skipped (its median mixes dense and sparse steps); dense runs keep it."""
    from sparrow.bench.rollout.real_run import STEP_WINDOW, replay_windows, sparse_step
    from sparrow.schedule import load_schedule

    schedule = load_schedule("qwen3-8b-0.86")
    assert not sparse_step(schedule, 512) and sparse_step(schedule, 513) and not sparse_step(None, 30000)
    profile = [{"first_context": 257 + i * STEP_WINDOW, "last_context": 256 + (i + 1) * STEP_WINDOW} for i in range(64)]
    sparse = replay_windows(profile, schedule, 2)
    assert [w["first_context"] for w in sparse] == [769, 257 + 63 * STEP_WINDOW]
    assert all(sparse_step(schedule, w["first_context"]) for w in sparse)
    assert [w["first_context"] for w in replay_windows(profile, None, 3)] == [257, 257 + 32 * STEP_WINDOW, 32513]
    assert replay_windows(profile[:1], schedule, 1) == []


def test_a_truncated_run_is_compared_over_the_steps_both_modes_made(tmp_path, capsys):
    """A dense run stopped at its time cap misses its slowest steps: the merge also reports sparse / dense over the
    whole step windows both runs have, and a run with no finished sample shows no blocks per token."""
    from sparrow.bench.rollout.real_run import STEP_WINDOW, common_steps_speedup

    def profile(ms_per_window, last_steps=STEP_WINDOW):
        windows = [{"first_context": 257 + i * STEP_WINDOW, "last_context": 256 + (i + 1) * STEP_WINDOW,
                    "median_ms": ms, "mean_ms": ms} for i, ms in enumerate(ms_per_window)]
        windows[-1]["last_context"] = windows[-1]["first_context"] + last_steps - 1
        return windows

    dense, sparse = profile([10.0, 20.0, 30.0], last_steps=100), profile([5.0, 8.0, 8.0, 9.0])
    common = common_steps_speedup(dense, sparse)
    assert common["steps"] == 2 * STEP_WINDOW  # dense's partial third window is left out
    assert common["dense_s"] == pytest.approx(30.0 * STEP_WINDOW / 1e3)
    assert common["speedup"] == pytest.approx(30.0 / 13.0)
    assert common_steps_speedup(profile([1.0], last_steps=3), sparse)["speedup"] is None
    args = ["bench", "rollout", "--model", "tiny", "--prompt-len", "40", "--gen-len", "6", "--batch", "2", "--budget", "3"]
    for mode in ("dense", "sparse"):
        assert main([*args, "--mode", mode, "--out", str(tmp_path / f"{mode}.json")]) == 0
    report = json.loads((tmp_path / "dense.json").read_text())
    report["modes"]["dense"] |= {"truncated": True, "mean_blocks": None, "step_profile": dense}
    (tmp_path / "dense.json").write_text(json.dumps(report))
    report = json.loads((tmp_path / "sparse.json").read_text())
    report["modes"]["sparse"]["step_profile"] = sparse
    (tmp_path / "sparse.json").write_text(json.dumps(report))
    capsys.readouterr()
    assert main(["bench", "rollout-merge", str(tmp_path / "dense.json"), str(tmp_path / "sparse.json")]) == 0
    out = capsys.readouterr().out
    assert f"over the first {2 * STEP_WINDOW} decode steps both made, sparse / dense 2.31x" in out
    assert out.splitlines()[3].split()[-2:] == ["-", "yes"]


def test_a_run_measured_in_segments_is_joined_into_the_whole_run(tmp_path, capsys, monkeypatch):
    """`--start-step`: a segment's samples start from prompts carrying their first N tokens, so its steps have the
    contexts of the whole run's from step N; rollout-merge joins segments of a mode and refuses gaps between them."""
    from sparrow.bench.rollout import real_run

    monkeypatch.setattr(real_run, "STEP_WINDOW", 4)
    args = ["bench", "rollout", "--model", "tiny", "--prompt-len", "40", "--gen-len", "13", "--batch", "4",
            "--samples", "2", "--budget", "3"]

    def run(mode, start, name):
        assert main([*args, "--mode", mode, "--start-step", str(start), "--out", str(tmp_path / name)]) == 0
        return json.loads((tmp_path / name).read_text())

    whole, tail, sparse = run("dense", 0, "dense-0.json"), run("dense", 8, "dense-8.json"), run("sparse", 0, "sparse.json")
    assert [w["first_context"] for w in whole["modes"]["dense"]["step_profile"]] == [41, 45, 49]
    assert tail["start_step"] == 8 and tail["modes"]["dense"]["decode_steps"] == 4
    assert [w["first_context"] for w in tail["modes"]["dense"]["step_profile"]] == [49]
    assert tail["modes"]["dense"]["decode_tokens"] == 4 * 4 and tail["modes"]["dense"]["errors"] == 0
    capsys.readouterr()
    files = [str(tmp_path / n) for n in ("dense-8.json", "sparse.json", "dense-0.json")]
    assert main(["bench", "rollout-merge", *files, "--out", str(tmp_path / "merged.json")]) == 0
    assert "dense: joined from 2 segments (decode steps 0-7 from " in capsys.readouterr().out
    joined = json.loads((tmp_path / "merged.json").read_text())["modes"]["dense"]
    assert [w["first_context"] for w in joined["step_profile"]] == [41, 45, 49]
    assert joined["step_profile"][2] == tail["modes"]["dense"]["step_profile"][0]
    assert joined["decode_steps"] == 12 and joined["decode_tokens"] == 4 * 12 and joined["mean_blocks"] is None
    seconds = sum(w["mean_ms"] * 4 for w in joined["step_profile"]) / 1e3
    assert joined["decode_tok_s"] == pytest.approx(4 * 12 / seconds)

    short = whole | {"modes": {"dense": whole["modes"]["dense"] | {
        "truncated": True, "step_profile": whole["modes"]["dense"]["step_profile"][:1]}}}
    (tmp_path / "short.json").write_text(json.dumps(short))
    assert main(["bench", "rollout-merge", str(tmp_path / "short.json"), files[0]]) == 2
    assert "made steps up to 3 only; run the later segment again with --start-step at a multiple of 4 no greater " \
           "than 4" in capsys.readouterr().err
    run("sparse", 8, "sparse-8.json")
    assert main(["bench", "rollout-merge", files[2], str(tmp_path / "sparse-8.json")]) == 2
    assert "start at different decode steps" in capsys.readouterr().err
    assert main([*args, "--start-step", "6"]) == 2
    assert "--start-step=6: use a multiple of 4" in capsys.readouterr().err


def test_end_step_cuts_a_segment_where_the_next_one_starts(tmp_path, capsys, monkeypatch):
    """`--end-step M`: a segment stops after decode step M - 1 (marked truncated), so segments [0, 4), [4, 8), [8, end)
    join into the whole run's steps with no gap or overlap, whatever the time each took."""
    from sparrow.bench.rollout import real_run

    monkeypatch.setattr(real_run, "STEP_WINDOW", 4)
    args = ["bench", "rollout", "--model", "tiny", "--prompt-len", "40", "--gen-len", "13", "--batch", "4",
            "--samples", "2", "--budget", "3", "--mode", "dense"]
    spans = [("0", "4"), ("4", "8"), ("8", None)]
    for start, end in spans:
        extra = ["--start-step", start] + (["--end-step", end] if end else [])
        assert main([*args, *extra, "--out", str(tmp_path / f"dense-{start}.json")]) == 0
    first = json.loads((tmp_path / "dense-0.json").read_text())
    assert first["end_step"] == 4 and first["modes"]["dense"]["decode_steps"] == 4
    assert first["modes"]["dense"]["truncated"] and first["modes"]["dense"]["errors"] == 0
    assert "from decode step 0 up to decode step 3 (other steps not measured here)" in capsys.readouterr().out
    files = [str(tmp_path / f"dense-{start}.json") for start, _ in spans]
    assert main(["bench", "rollout-merge", *files, "--out", str(tmp_path / "merged.json")]) == 0
    assert "dense: joined from 3 segments (decode steps 0-3 from " in capsys.readouterr().out
    joined = json.loads((tmp_path / "merged.json").read_text())["modes"]["dense"]
    assert [w["first_context"] for w in joined["step_profile"]] == [41, 45, 49]
    assert joined["decode_steps"] == 12 and not joined["truncated"]
    for bad in (["--end-step", "6"], ["--start-step", "4", "--end-step", "4"], ["--end-step", "16"]):
        assert main([*args, *bad]) == 2
        assert "--end-step=" in capsys.readouterr().err


def test_kernel_gaps_name_the_edges_where_the_gpu_idles():
    """The decode-step profile's idle time: gaps between one kernel's end and the next one's start, summed per pair
    of kernels; an overlapping kernel (a dependent launched early) leaves no gap, and the span covers them all."""
    from sparrow.bench.rollout.filled import kernel_gaps

    timeline = [("gemm", 0.0, 10.0), ("norm", 12.0, 13.0), ("gemm", 13.5, 23.5), ("norm", 25.5, 26.0),
                ("merge", 25.8, 27.0), ("attn", 20.0, 24.0)]
    gaps = kernel_gaps(timeline, top=2)
    assert gaps["span_us"] == 27.0 and gaps["gap_us"] == pytest.approx(2.0 + 0.5 + 1.5)
    assert gaps["gaps"] == [{"before": "gemm", "after": "norm", "count": 1, "us": 2.0},
                            {"before": "attn", "after": "norm", "count": 1, "us": 1.5}]
    assert kernel_gaps([]) == {"span_us": 0.0, "gap_us": 0.0, "gaps": []}


def test_step_breakdown_puts_each_kernel_group_beside_the_bytes_it_must_move():
    """The decode-step profile grouped by job: attention against the K/V, GEMMs (cuBLAS families, the split-K reduce
    too) against the weights, scoring against landmarks + the scores it writes, selection against the scores it
    reads; merge, small kernels and idle time have no floor. Rows sum to the span; the span's excess is the step's."""
    from sparrow.bench.rollout.breakdown import kernel_kinds, step_breakdown

    kinds = kernel_kinds([("_decode_attention_kernel", 36, 6426.0), ("nvjet_sm90_tst_192x24_64x7_4x1_v_bz_TNT", 36, 1075.0),
                          ("void cublasLt::splitKreduce_kernel<32, 16>", 72, 136.0), ("_score_kernel", 34, 934.0),
                          ("_select_kernel", 34, 492.0), ("_merge_splits_kernel", 36, 143.0),
                          ("_add_rms_norm_kernel", 73, 144.0), ("_silu_mul_kernel", 36, 52.0)])
    assert kinds["GEMMs"] == {"calls": 108, "us": 1211.0} and kinds["other"] == {"calls": 109, "us": 196.0}
    nbytes = {"weights": 8_000_000_000, "dense_kv": 6_000_000_000, "sparse_kv": 20_000_000_000,
              "landmarks": 3_000_000_000, "scores": 100_000_000}
    rows = {r["kind"]: r for r in step_breakdown(kinds, 279.0, nbytes, copy_gbps=4000.0)}
    assert rows["attention"]["floor_us"] == pytest.approx(6500.0) and rows["attention"]["above_us"] == pytest.approx(-74.0)
    assert rows["GEMMs"]["floor_us"] == pytest.approx(2000.0)
    assert rows["scoring"]["floor_us"] == pytest.approx(762.5) and rows["selection"]["floor_us"] == pytest.approx(12.5)
    assert rows["merge"]["floor_us"] is None and rows["merge"]["above_us"] == 143.0
    assert rows["idle between kernels"] == {"kind": "idle between kernels", "calls": 0, "us": 279.0, "floor_us": None,
                                            "above_us": 279.0}
    assert sum(r["us"] for r in rows.values()) == pytest.approx(6426 + 1211 + 934 + 492 + 143 + 196 + 279)
    dense_only = {r["kind"] for r in step_breakdown(kernel_kinds([("_decode_attention_kernel", 2, 5.0)]), 0.0, nbytes, 4000.0)}
    assert dense_only == {"attention", "idle between kernels"}  # groups without kernels get no row
    from sparrow.bench.rollout.decode_step import render_breakdown

    text = render_breakdown("32768-sparse", {"breakdown": list(rows.values()), "kernels": 361, "span_us": 11293.0,
                                             "floor_us": 8977.0})
    assert "where the 32768-sparse step goes" in text
    assert text.splitlines()[-1].split() == ["span", "361", "11293", "-", "8977", "2316"]


def test_segment_bounds_balance_the_growing_step_cost():
    """`--segments`: boundaries on the 512-step windows, later segments shorter (a dense step's cost grows with its
    context, and a later segment prefills a longer prompt first), each segment about the same estimated time; too
    many segments for the windows is refused."""
    from sparrow.bench.rollout.real_run import (SEGMENT_FIXED_TOKENS, SEGMENT_PREFILL_TOKENS,
                                                               segment_bounds)

    bounds = segment_bounds(0, 32767, 4, 256, "dense")
    assert bounds == [(0, 16384), (16384, 23040), (23040, 28672), (28672, 32767)]
    offset, prefill = SEGMENT_FIXED_TOKENS["dense"] + 256, SEGMENT_PREFILL_TOKENS["dense"]
    cost = [prefill * a + sum(offset + t for t in range(a, b)) for a, b in bounds]
    assert max(cost) / min(cost) < 1.15  # a boundary moves at most half a window off the exact split
    assert segment_bounds(0, 32767, 2, 256, "sparse") == [(0, 22016), (22016, 32767)]
    assert segment_bounds(20480, 32767, 2, 256, "both") == [(20480, 27648), (27648, 32767)]
    assert segment_bounds(0, 1024, 2, 40, "dense") == [(0, 512), (512, 1024)]
    with pytest.raises(ValueError, match="--segments=3: decode steps 0-1023 make 2 step-profile window"):
        segment_bounds(0, 1024, 3, 40, "dense")


def test_segments_measure_a_run_in_parallel_processes_and_join_it(tmp_path, capsys):
    """`--segments 2`, one mode per run as on the GPU: two processes measure decode steps 0-511 and 512-1023 at once
    (one GPU each on CUDA); each report is the joined whole run of one command, no segment truncated at the end, and
    rollout-merge compares the two modes' segmented runs."""
    args = ["bench", "rollout", "--model", "tiny", "--prompt-len", "40", "--gen-len", "1025", "--batch", "4",
            "--samples", "2", "--budget", "3", "--threads", "1", "--segments", "2"]
    files = [str(tmp_path / f"{mode}.json") for mode in ("dense", "sparse")]
    for mode, path in zip(("dense", "sparse"), files):
        assert main([*args, "--mode", mode, "--out", path]) == 0
        out = capsys.readouterr().out
        assert f"{mode}: joined from 2 segments (decode steps 0-511 from segment 0, 512-1023 from segment 1)" in out
        report = json.loads(Path(path).read_text())
        result = report["modes"][mode]
        assert result["decode_steps"] == 1024 and not result["truncated"] and result["errors"] == 0
        assert [w["first_context"] for w in result["step_profile"]] == [41, 553]
        assert report["command"].startswith("sparrow bench rollout") and "commands" not in report
    assert main(["bench", "rollout-merge", *files, "--out", str(tmp_path / "merged.json")]) == 0
    out = capsys.readouterr().out
    assert "a run was truncated" not in out and "(byte floor " in out
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert merged["decode_speedup"] > 0 and len(merged["commands"]) == 2 and merged["byte_floor_speedup"] > 1
    assert main([*args, "--segments", "2", "--time-cap", "60"]) == 2
    assert "drop --tensor-parallel and --time-cap" in capsys.readouterr().err


def test_real_rollout_times_the_whole_loop_host_work_included(tiny_qwen3, monkeypatch):
    """The decode steps' times add up to the run's wall clock: host work outside `engine.step()` (here a progress
    callback that sleeps 50 ms every window) is counted, as it must be with overlapped decode, where the GPU runs the
    next step while the host is outside the call. The overlapped loop's last step only reads the one in flight."""
    import time

    from sparrow.bench.rollout import real_run

    monkeypatch.setattr(real_run, "STEP_WINDOW", 4)
    engine = NativeEngine.from_pretrained(tiny_qwen3, overlap_decode=True)
    requests = real_run.protocol_requests([tuple(range(5, 45))], 2, 13)
    res = real_run.real_rollout(engine, requests, progress=lambda steps, seconds: time.sleep(0.05))
    assert res["decode_steps"] == 12 and res["decode_reads"] == 1 and res["errors"] == 0
    assert res["decode_seconds"] >= 3 * 0.05  # three windows, each followed by a sleep
    assert res["decode_seconds"] + res["prefill_seconds"] <= res["wall_s"]
    windows = sum(w["mean_ms"] * (w["last_context"] - w["first_context"] + 1) for w in res["step_profile"]) / 1e3
    assert windows == pytest.approx(res["decode_seconds"])
