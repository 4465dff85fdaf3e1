"""Tensor parallelism of the native engine: two ranks (processes, gloo on CPU) give the single-process
engine's tokens, logprobs and blocks attended, dense and sparse, before and after a weight update, and
exactly the same samples as each other (lockstep); a bad update is refused by both ranks; a
tensor_parallel_size that does not divide the model is refused naming the sizes that do, and a job (Ray
rollout workers) with tensor_parallel_size > 1 is refused: not wired there yet. The GPU variant (NCCL,
one GPU a rank, eager and with CUDA graphs) runs the same scenario where two CUDA devices exist."""

import json
import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import distributed as dist

from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine, NativeEngineConfig, WeightsError
from sparrow.schedule import SparsitySchedule

SMALL = SparsitySchedule(name="small", topk_blocks=(2, 4), edges=(160,))  # 5 blocks, then 7 beyond 160 tokens
REQUESTS = [
    RolloutRequest("greedy-a", tuple(range(3, 110)), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),
    RolloutRequest("greedy-b", tuple(range(200, 290, 2)), SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)),
    RolloutRequest("sampled", tuple(range(50, 150)),
                   SamplingParams(max_tokens=30, temperature=1.0, seed=7, n=2, ignore_eos=True)),
]
BAD_KEY = "model.layers.1.self_attn.q_proj.weight"
BAD_ROW = 100
"""A NaN in row 100 of a [128, 64] q_proj weight: in rank 1's shard only (rows 64..127)."""


def new_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The 'next policy version': every tensor moved by seeded noise (the same in every process)."""
    tensors = load_file(Path(model_dir) / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    return {k: tensors[k] + 0.05 * torch.randn(tensors[k].shape, generator=gen) for k in sorted(tensors)}


def outputs(samples) -> list[tuple]:
    return [(s.token_ids.cpu(), s.logprobs.cpu(), s.blocks_attended.cpu()) for s in samples]


def scenario(model_dir: Path, **options) -> dict:
    """Dense, then sparse, then sparse after a weight update, then after a refused update."""
    engine = NativeEngine.from_pretrained(model_dir, max_model_len=512, max_num_seqs=4, **options)
    runs = {}
    for name, schedule in (("dense", None), ("sparse", SMALL)):
        engine.set_schedule(schedule)
        runs[name] = outputs(engine.generate(REQUESTS))
    update = new_weights(model_dir)
    engine.load_weights(update, version=1)
    runs["updated"] = outputs(engine.generate(REQUESTS))
    bad = dict(update)
    bad[BAD_KEY] = update[BAD_KEY].clone()
    bad[BAD_KEY][BAD_ROW, 0] = float("nan")
    try:
        engine.load_weights(bad, version=2)
    except WeightsError as exc:
        runs["refused"] = str(exc)
    runs["after_refusal"] = outputs(engine.generate(REQUESTS))
    runs["policy_version"] = engine.policy_version
    runs["cuda_graphs_captured"] = engine.stats()["cuda_graphs_captured"]
    runs["all_reduce"] = engine.stats()["all_reduce"]
    return runs


def rank_main(rank: int, workdir: Path, models: dict[str, Path], backend: str, options: dict) -> None:
    torch.set_num_threads(1)
    device = "cpu" if backend == "gloo" else f"cuda:{rank}"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=2)
    try:
        runs = {name: scenario(path, tensor_parallel_size=2, device=device, **options) for name, path in models.items()}
        torch.save(runs, workdir / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def biased_llama(out: Path) -> Path:
    """A random Llama with q/k/v, o_proj and MLP biases and an untied lm_head: the row-parallel bias rule."""
    from transformers import AutoModelForCausalLM

    from sparrow.model_zoo.tiny import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        tiny_config("llama", 512, tie_word_embeddings=False, attention_bias=True, mlp_bias=True), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 or name.endswith("bias"):
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    return out


def check_parity(models: dict[str, Path], workdir: Path, backend: str, tolerance: float, **options) -> None:
    from sparrow.bench.rollout.rollout import run_ranks

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    run_ranks(rank_main, (workdir, models, backend, options), 2, [workdir / f"rank{r}.pt" for r in range(2)])
    ranks = [torch.load(workdir / f"rank{r}.pt") for r in range(2)]
    device = "cpu" if backend == "gloo" else "cuda:0"
    for name, path in models.items():
        single = scenario(path, device=device, **options)
        rank0, rank1 = ranks[0][name], ranks[1][name]
        assert single["refused"].startswith(BAD_KEY + ": contains NaN")
        assert rank1["refused"].startswith(BAD_KEY + ": contains NaN")
        assert "another tensor-parallel rank refused" in rank0["refused"]
        assert single["policy_version"] == rank0["policy_version"] == rank1["policy_version"] == 1
        if backend == "nccl" and options.get("cuda_graphs") is not False:  # decode from CUDA graphs, all-reduces captured
            assert rank0["cuda_graphs_captured"] > 0 and rank1["cuda_graphs_captured"] > 0
        # decode all-reduces through symmetric memory on CUDA (prefill chunks over NCCL), gloo's own on the CPU
        path = {"gloo": "gloo (not CUDA)", "nccl": "symmetric-memory one-shot"}[backend]
        if options.get("symmetric_memory_all_reduce") is False:
            path = f"{backend} (symmetric_memory_all_reduce=False)"
        assert rank0["all_reduce"] == rank1["all_reduce"] == path, (rank0["all_reduce"], rank1["all_reduce"])
        assert single["all_reduce"] is None
        for run in ("dense", "sparse", "updated", "after_refusal"):
            for (t0, l0, b0), (t1, l1, b1), (t, lp, b) in zip(rank0[run], rank1[run], single[run]):
                assert torch.equal(t0, t1) and torch.equal(l0, l1) and torch.equal(b0, b1), (name, run)
                assert torch.equal(t0, t) and torch.equal(b0, b), (name, run)
                assert (l0 - lp).abs().max().item() < tolerance, (name, run)
        dense_blocks = torch.cat([b for _, _, b in single["dense"]])
        assert (torch.cat([b for _, _, b in single["sparse"]]) < dense_blocks).any(), "the budget never bit"
        assert not torch.equal(single["updated"][0][0], single["sparse"][0][0]), "the update changed nothing"


def test_two_gloo_ranks_match_the_single_process_engine(tiny_qwen3, tmp_path):
    models = {"qwen3": tiny_qwen3, "llama-biases": biased_llama(tmp_path / "llama")}
    check_parity(models, tmp_path, "gloo", 1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs,symmetric_memory", [(False, True), (None, True), (None, False)],
                         ids=["eager", "cuda-graphs", "cuda-graphs-nccl-only"])
def test_two_nccl_ranks_match_the_single_gpu_engine(tiny_qwen3, tmp_path, cuda_graphs, symmetric_memory):
    """cuda_graphs False = eager launches; None = the default, the decode steps from CUDA graphs with the all-reduces
    captured. The decode-sized all-reduces go through symmetric memory unless it is switched off (NCCL for all)."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    models = {"qwen3": tiny_qwen3, "llama-biases": biased_llama(tmp_path / "llama")}
    check_parity(models, tmp_path, "nccl", 1e-3, dtype="float32", attention_backend="triton", cuda_graphs=cuda_graphs,
                 symmetric_memory_all_reduce=symmetric_memory)


def test_a_size_that_does_not_divide_the_model_is_refused(tiny_qwen3):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 must divide num_attention_heads=4, "
                                         r"num_key_value_heads=2, intermediate_size=128 .*sizes that do: 1, 2"):
        NativeEngine.from_pretrained(tiny_qwen3, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="needs torch.distributed initialised"):
        NativeEngine.from_pretrained(tiny_qwen3, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"rollout.native.tensor_parallel_size=2: the rollout workers do not run"):
        NativeEngineConfig(tensor_parallel_size=2).check_job(SamplingParams(), None, "rollout", "native")


def test_bench_rollout_over_two_ranks_measures_what_one_process_does(capsys):
    """`sparrow bench rollout --tensor-parallel 2` (gloo ranks), plain and with the overlapped decode: the same
    decode steps, tokens and blocks attended as one process; under a time cap both ranks stop at the same step (one stopping alone would leave the other
    waiting in an all-reduce); a size that does not divide the model is refused before any rank starts."""
    from sparrow.cli.main import main

    common = ["bench", "rollout", "--model", "tiny", "--prompt-len", "64", "--gen-len", "40", "--batch", "4",
              "--samples", "2", "--budget", "3", "--threads", "1", "--json"]
    reports = []
    for extra in (["--tensor-parallel", "1"], ["--tensor-parallel", "2"],
                  ["--tensor-parallel", "2", "--overlap-decode", "--nccl-all-reduce"]):
        assert main([*common, *extra]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    one, two, overlapped = reports
    assert (one["tensor_parallel"], two["tensor_parallel"], overlapped["overlap_decode"]) == (1, 2, True)
    assert (one["all_reduce"], two["all_reduce"]) == (None, "gloo (not CUDA)")
    assert overlapped["all_reduce"] == "gloo (symmetric_memory_all_reduce=False)"
    for mode in ("dense", "sparse"):
        a, b, c = one["modes"][mode], two["modes"][mode], overlapped["modes"][mode]
        assert a["decode_steps"] == b["decode_steps"] == c["decode_steps"] == 39
        assert a["decode_tokens"] == b["decode_tokens"] == c["decode_tokens"] == 4 * 39
        assert a["mean_blocks"] == b["mean_blocks"] == c["mean_blocks"] and a["errors"] == b["errors"] == c["errors"] == 0
    assert two["modes"]["sparse"]["mean_blocks"] < two["modes"]["dense"]["mean_blocks"]

    capped = [*common, "--gen-len", "400", "--tensor-parallel", "2", "--mode", "dense", "--time-cap", "0.01"]
    assert main(capped) == 0
    dense = json.loads(capsys.readouterr().out)["modes"]["dense"]
    assert dense["truncated"] and dense["decode_steps"] < 399

    assert main([*common, "--model", "smollm2-135m", "--tensor-parallel", "2"]) == 2
    assert "sizes that do: 1, 3" in capsys.readouterr().err


def _report_then_hang(rank: int, report: str) -> None:
    if rank == 0:
        Path(report).write_text(json.dumps({"decode_tok_s": 1.0}))
    time.sleep(600)


def test_ranks_hung_after_the_report_are_stopped_and_the_report_kept(tmp_path, capfd):
    """On 2 x H200 both 8B tensor-parallel runs decoded to the end but their ranks never returned, and the
    results were lost with them: once rank 0 has written the report, ranks get a grace period, then are killed."""
    from sparrow.bench.rollout.rollout import run_ranks

    start = time.monotonic()
    run_ranks(_report_then_hang, (str(tmp_path / "report.json"),), 2, [tmp_path / "report.json"], grace_s=1.0)
    assert json.loads((tmp_path / "report.json").read_text()) == {"decode_tok_s": 1.0}
    assert time.monotonic() - start < 60
    assert "still running 1 s after writing their results" in capfd.readouterr().err
