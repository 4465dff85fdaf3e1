"""`sparrow bench rollout-paper`: the paper's 32K rollout protocol on one GPU, real run + projection."""

from pathlib import Path

import torch

from sparrow.kernels import SparseAttentionConfig
from sparrow.rollout_workers.native.kv_cache import bytes_per_block
from sparrow.rollout_workers.native.model import DecoderModel
from sparrow.rollout_workers.native.shapes import spec_for_shape
from sparrow.schedule import SparsitySchedule, load_schedule
from sparrow.tables import format_table

from .common import (DEVICE, DTYPE, PAPER_ROLLOUT_SPEEDUP, TARGET_OVER_PAPER, device_report, require_cuda, write_report,
                     default_out_path)
from .filled import FilledDecode, free_gpu_memory
from .floor import byte_floor_speedup
from .real_run import protocol_requests, real_rollout, sparse_step


def protocol_batch(model: DecoderModel, attention: SparseAttentionConfig, max_len: int, samples: int,
                   memory_fraction: float, kv_cache_dtype: str = "auto") -> int:
    """The most sequences, in whole groups of `samples`, whose `max_len`-token KV fits in
    `memory_fraction` of the free memory (what a continuous-batching engine would keep running)."""
    per_seq = attention.blocks_for(max_len) * bytes_per_block(model.spec, attention, model.dtype, kv_cache_dtype)
    fits = int(memory_fraction * free_gpu_memory() // per_seq)
    if fits < samples:
        raise ValueError(f"one group of {samples} sequences of {max_len} tokens does not fit ({fits} sequences do)")
    return fits // samples * samples


def regimes(schedule: SparsitySchedule | None, lo: int, hi: int, block_size: int, dense_every: int = 4096,
            extra_cuts=()) -> list[tuple[int, int]]:
    """Split contexts [lo, hi] into ranges on which the decode step's time is linear in the context:
    the budget, the dense/sparse choice and the block-table width bucket are constant inside each."""
    cuts = {lo, hi + 1, *[c for c in extra_cuts if lo < c <= hi]}
    k = 16
    while k * block_size + 1 <= hi:  # `width_bucket` changes when the block count passes a power of two (>= 16)
        cuts.add(k * block_size + 1)
        k *= 2
    if schedule is None:
        cuts.update(range(lo + dense_every, hi + 1, dense_every))
    else:
        for i in range(schedule.num_bins):
            first, _ = schedule.bin_range(i)
            cuts.add(first)
            budget = schedule.blocks_for_bin(i)
            if budget is not None:
                cuts.add(budget * block_size + 1)  # from here the row no longer fits its budget
    cuts = sorted(c for c in cuts if lo <= c <= hi + 1)
    return [(a, b - 1) for a, b in zip(cuts, cuts[1:])]


def integrate(times: dict[int, float], ranges: list[tuple[int, int]], lo: int, hi: int) -> float:
    """Σ_{L=lo}^{hi} t(L) with t linear inside each range between its measured end points."""
    total = 0.0
    for a, b in ranges:
        x, y = max(a, lo), min(b, hi)
        if x > y:
            continue
        ta, tb = times[a], times[b]

        def at(c):
            return ta if a == b else ta + (tb - ta) * (c - a) / (b - a)

        total += (y - x + 1) * (at(x) + at(y)) / 2
    return total


def measure_step_times(filled: FilledDecode, schedule: SparsitySchedule | None, ranges, replays: int) -> dict[int, float]:
    """Step + sampler ms at both ends of every range (the schedule's budget applied on the device)."""
    filled.graphs.set_schedule(schedule)
    out = {}
    for context in sorted({c for r in ranges for c in r}):
        out[context] = filled.time(context, sparse_step(schedule, context), replays)["total_ms"]
    return out


def run_model(name: str, schedules: list[str], real_prompt: int, real_gen: int, project_prompt: int,
              project_gen: int, samples: int, memory_fraction: float, time_cap_s: float, replays: int, log) -> dict:
    from sparrow.rollout_workers.native.config import NativeEngineConfig
    from sparrow.rollout_workers.native.engine import NativeEngine

    attention = SparseAttentionConfig()
    bs = attention.block_size
    spec = spec_for_shape(name)
    project_len = project_prompt + project_gen
    real_len = real_prompt + real_gen
    model = DecoderModel(spec, max(project_len, real_len) + bs, device=DEVICE, dtype=DTYPE).init_random(0)
    batch = protocol_batch(model, attention, project_len, samples, memory_fraction)
    free_after_model = free_gpu_memory()
    groups = batch // samples
    log(f"{name}: batch {batch} ({groups} prompts x {samples}) fits {project_len} tokens each "
        f"({free_after_model / 1e9:.1f} GB free after the weights, {memory_fraction:.0%} of it for the KV cache)")
    gen = torch.Generator().manual_seed(0)
    out = {"model": name, "batch": batch, "samples": samples, "schedules": schedules, "real": {}, "projection": {}}

    # (a) real end-to-end run, CUDA graphs captured up front
    engine = NativeEngine(NativeEngineConfig(
        device=DEVICE, dtype=str(DTYPE).removeprefix("torch."), attention_backend="triton", max_num_seqs=batch,
        num_kv_blocks=batch * attention.blocks_for(real_len + 1) + 2 * batch, max_model_len=real_len + bs,
        prefill_chunk_size=max(2048, real_prompt)), model=model)
    schedule = load_schedule(schedules[0])
    engine.set_schedule(schedule)
    if engine.stats()["cuda_graphs"]:
        engine.capture_decode_graphs([batch], real_len)
    prompts = [tuple(torch.randint(0, spec.vocab_size, (real_prompt,), generator=gen).tolist()) for _ in range(groups)]
    for mode in (None, schedule):  # warm-up: prefill and sampler kernels
        engine.set_schedule(mode)
        real_rollout(engine, protocol_requests(prompts, samples, 2), time_cap_s)
    for label, mode in (("dense", None), ("sparse", schedule)):
        engine.set_schedule(mode)
        res = real_rollout(engine, protocol_requests(prompts, samples, real_gen), time_cap_s)
        out["real"][label] = res
        log(f"  real {label}: {res['decode_tok_s']:.0f} decode tok/s over {res['decode_steps']} steps "
            f"({res['decode_seconds']:.1f} s, median step {res['median_step_ms']:.2f} ms, last step "
            f"{res['last_step_ms']:.0f} ms){' TRUNCATED' if res['truncated'] else ''}")
    prefill_rate = groups * real_prompt / max(out["real"]["dense"]["prefill_seconds"], 1e-9)  # prompt tokens/s
    del engine
    free_gpu_memory()

    # (b) measured step times on a filled cache
    filled = FilledDecode(model, attention, batch, project_len)
    # decode step i of a sample (i = 1 .. gen-1) runs at context prompt + i; a truncated run stopped earlier
    real_hi = {m: real_prompt + r["decode_steps"] for m, r in out["real"].items()}
    proj_lo, proj_hi = project_prompt + 1, project_len - 1
    lo, hi = min(real_prompt + 1, proj_lo), max(*real_hi.values(), proj_hi)
    cuts = (real_prompt + 1, proj_lo, proj_hi + 1, *[h + 1 for h in real_hi.values()])
    dense_ranges = regimes(None, lo, hi, bs, extra_cuts=cuts)
    dense_times = measure_step_times(filled, None, dense_ranges, replays)
    out["projection"]["dense_points_ms"] = dense_times
    prefill_s = groups * project_prompt / prefill_rate
    for sched_name in schedules:
        sched = load_schedule(sched_name)
        ranges = regimes(sched, lo, hi, bs, extra_cuts=cuts)
        times = measure_step_times(filled, sched, ranges, replays)
        dense_real = integrate(dense_times, dense_ranges, real_prompt + 1, real_hi["dense"]) / 1e3
        sparse_real = integrate(times, ranges, real_prompt + 1, real_hi["sparse"]) / 1e3
        dense_s = integrate(dense_times, dense_ranges, proj_lo, proj_hi) / 1e3
        sparse_s = integrate(times, ranges, proj_lo, proj_hi) / 1e3
        decode_tokens = batch * (proj_hi - proj_lo + 1)
        gen_tokens = decode_tokens + batch  # the first token of each sample comes from the prefill
        entry = {"points_ms": times, "real_range": {
            "dense_decode_s": dense_real, "sparse_decode_s": sparse_real,
            "speedup": (dense_real / (real_hi["dense"] - real_prompt)) / (sparse_real / (real_hi["sparse"] - real_prompt)),
        }, "protocol": {
            "contexts": [proj_lo, proj_hi], "dense_decode_s": dense_s, "sparse_decode_s": sparse_s,
            "dense_decode_tok_s": decode_tokens / dense_s, "sparse_decode_tok_s": decode_tokens / sparse_s,
            "speedup": dense_s / sparse_s, "prefill_s_estimate": prefill_s,
            "dense_tok_s": gen_tokens / (dense_s + prefill_s), "sparse_tok_s": gen_tokens / (sparse_s + prefill_s),
        }}
        entry["protocol"]["total_speedup"] = entry["protocol"]["sparse_tok_s"] / entry["protocol"]["dense_tok_s"]
        entry["protocol"]["byte_floor_speedup"] = byte_floor_speedup(spec, sched, attention, batch, proj_lo, proj_hi)
        out["projection"][sched_name] = entry
        p = entry["protocol"]
        log(f"  projection {sched_name}: 32K protocol {p['dense_decode_tok_s']:.0f} -> {p['sparse_decode_tok_s']:.0f} "
            f"decode tok/s ({p['speedup']:.2f}x)")
    r = out["projection"][schedules[0]]["real_range"]
    real = out["real"]
    r["real_over_projected_dense"] = real["dense"]["decode_seconds"] / r["dense_decode_s"]
    r["real_over_projected_sparse"] = real["sparse"]["decode_seconds"] / r["sparse_decode_s"]
    r["real_speedup"] = real["sparse"]["decode_tok_s"] / real["dense"]["decode_tok_s"]
    out["free_memory_after_model_GB"] = free_after_model / 1e9
    filled.release()
    del filled, model
    free_gpu_memory()
    return out


def run_rollout_paper(models=("qwen3-1.7b", "qwen3-4b", "qwen3-8b"), schedules: dict[str, list[str]] | None = None,
                      real_prompt: int = 1800, real_gen: int = 3072, project_prompt: int = 256,
                      project_gen: int = 32768, samples: int = 8, memory_fraction: float = 0.95,
                      time_cap_s: float = 90.0, replays: int = 5, out_path: Path | None = None, command: str = "",
                      log=print) -> dict:
    require_cuda("rollout-paper")
    out_path = out_path or default_out_path("rollout-paper")
    schedules = schedules or {}
    report = device_report(command)
    report.update(real_prompt=real_prompt, real_gen=real_gen, project_prompt=project_prompt, project_gen=project_gen,
                  samples=samples, memory_fraction=memory_fraction, models=[])
    for name in models:
        names = schedules.get(name) or default_schedules(name)
        report["models"].append(run_model(name, names, real_prompt, real_gen, project_prompt, project_gen, samples,
                                          memory_fraction, time_cap_s, replays, log))
        write_report(report, out_path, lambda *_: None)
    write_report(report, out_path, log)
    log(render_rollout_paper(report))
    return report


def default_schedules(name: str) -> list[str]:
    """The 0.86 tables; for 8B also 0.87, which the paper's Fig. 4c 8B curve at 0.86 equals."""
    key = name.lower()
    return [f"{key}-0.86", f"{key}-0.87"] if key == "qwen3-8b" else [f"{key}-0.86"]


def render_rollout_paper(report: dict) -> str:
    real_rows, proj_rows = [], []
    for m in report["models"]:
        real, first = m["real"], m["projection"][m["schedules"][0]]["real_range"]
        real_rows.append([
            m["model"], m["schedules"][0], m["batch"], f"{report['real_prompt']}+{real['dense']['decode_steps'] + 1}",
            f"{real['dense']['decode_tok_s']:.0f}", f"{real['sparse']['decode_tok_s']:.0f}", f"{first['real_speedup']:.2f}x",
            f"{first['speedup']:.2f}x", f"{first['real_over_projected_dense']:.2f}", f"{first['real_over_projected_sparse']:.2f}",
        ])
        paper = PAPER_ROLLOUT_SPEEDUP.get(m["model"])
        for sched in m["schedules"]:
            p = m["projection"][sched]["protocol"]
            proj_rows.append([
                m["model"], sched, m["batch"], f"{p['dense_tok_s']:.0f}", f"{p['sparse_tok_s']:.0f}",
                f"{p['total_speedup']:.2f}x", f"{p['byte_floor_speedup']:.2f}x", "-" if paper is None else f"{paper:.2f}x",
                "-" if paper is None else f"{TARGET_OVER_PAPER * paper:.2f}x",
            ])
    real_table = format_table(["model", "schedule", "batch", "prompt+gen", "dense tok/s", "sparse tok/s", "speedup",
                               "projected speedup", "real/proj time dense", "real/proj time sparse"], real_rows)
    proj_table = format_table(["model", "schedule", "batch", "dense tok/s", "sparse tok/s", "speedup", "byte floor",
                               "paper (4xH200)", "target"], proj_rows)
    return (f"(a) real end-to-end runs on {report['device']} (decode tokens/s; CUDA graphs):\n{real_table}\n"
            f"(b) PROJECTION to the 32K protocol ({report['project_prompt']}-token prompts + {report['project_gen']} "
            f"generated, {report['samples']} samples per prompt) from measured step times:\n{proj_table}")
