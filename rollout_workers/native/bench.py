"""GPU benchmarks of the native engine: `sparrow bench decode-step` and `sparrow bench rollout-paper`.

decode-step: the full-model decode step at the points of Sparrow's Table 4 (one GPU, batch 8, past KV
16K / 24K / 32K, a 1024-token budget), dense and sparse, replayed from the engine's CUDA graphs. The KV
cache is filled directly with random values (speed does not depend on them), every sequence's block
table is a random slice of the pool, and the time is the median over many replays, next to the
bytes-moved floor at the copy bandwidth measured in the same run.

rollout-paper: the paper's rollout protocol (8 samples per prompt, generation forced to 32K tokens,
dense vs the 0.86 schedules) on one GPU, in two parts per model:
  (a) a real end-to-end run of the engine (continuous batching, prefill, sampling, CUDA graphs) at a
      shorter generation whose contexts cross several schedule bins;
  (b) a projection to the 32K protocol from measured step times: graph-replayed decode steps (model +
      sampler) at contexts spread over 0–32K on a filled cache, at the batch the protocol implies (the
      most groups of 8 whose 32K KV fits), integrated over the generation. The same step times,
      integrated over (a)'s range, predict (a)'s decode time: that comparison is the projection's check.
"""

import datetime
import gc
import json
import time
from pathlib import Path

import torch

from sparrow.kernels import SparseAttentionConfig
from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.schedule import SparsitySchedule, load_schedule
from sparrow.tables import format_table

from .cuda_graphs import DecodeGraphs, DecodeStep
from .kv_cache import KVCache, bytes_per_block
from .model import DecoderModel
from .sampler import SamplingBatch, sample
from .scheduler import blocks_for
from .shapes import spec_for_shape

RESULTS_DIR = Path("benchmarks/results")
DEVICE, DTYPE = "cuda", torch.bfloat16
PAPER_STEP_MS = {16384: 4.59, 24576: 5.13, 32768: 5.41}
"""Sparrow Table 4: full decode step, one H200, batch 8, 1024-token budget (16 × 64-token pages)."""
PAPER_ROLLOUT_SPEEDUP = {"qwen3-1.7b": 2.21, "qwen3-4b": 2.41, "qwen3-8b": 2.06}
"""Sparrow: rollout throughput sparse/dense at the 0.86 schedules, 4×H200, 32K generation, AIME × 8."""
TARGET_OVER_PAPER = 1.25


def _device_report(command: str) -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "num_sms": props.multi_processor_count,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "torch": torch.__version__, "triton": triton.__version__}


def default_out_path(kind: str) -> Path:
    name = torch.cuda.get_device_properties(0).name
    slug = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    return RESULTS_DIR / f"{kind}-{slug}-{stamp}.json"


def _write(report: dict, out_path: Path | None, log) -> None:
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=1))
        log(f"wrote {out_path}")


def _require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise ValueError(f"sparrow bench {what} needs a CUDA GPU (CUDA graphs and the Triton kernels)")


# ------------------------------------------------------------------------------------- bytes floor


def weight_bytes(model: DecoderModel) -> int:
    """Parameters read per decode step: all of them, except an untied embedding (only B rows are read)."""
    total = sum(p.numel() for p in model.parameters())
    if model.lm_head is not None:
        total -= model.model.embed_tokens.weight.numel()
    return total * model.dtype.itemsize


def step_bytes(model: DecoderModel, attention: SparseAttentionConfig, batch: int, context: int,
               budget_blocks: int | None) -> dict:
    """Bytes one decode step must move at `context` tokens per sequence (the new one included):
    weights, K/V of dense layers, and in sparse layers the attended K/V (partial block by its valid
    tokens), the candidates' landmarks and their fp32 scores (written once, read once)."""
    spec, item = model.spec, model.dtype.itemsize
    bs = attention.block_size
    kv_tok = spec.num_kv_heads * spec.head_dim * 2 * item  # K and V of one token in one layer
    n = blocks_for(context, bs)
    dense_layers = sum(1 for i in range(spec.num_layers) if attention.is_dense_layer(i))
    sparse_layers = spec.num_layers - dense_layers
    out = {"weights": weight_bytes(model), "dense_kv": dense_layers * batch * context * kv_tok}
    if budget_blocks is None or n <= budget_blocks:
        out.update(sparse_kv=sparse_layers * batch * context * kv_tok, landmarks=0, scores=0)
    else:
        attended = (budget_blocks - 1) * bs + context - (n - 1) * bs
        candidates = n - attention.sink - attention.recent
        width = attention.landmark_width(spec.head_dim)
        out.update(sparse_kv=sparse_layers * batch * attended * kv_tok,
                   landmarks=sparse_layers * batch * candidates * spec.num_kv_heads * width * item,
                   scores=sparse_layers * batch * candidates * spec.num_kv_heads * 8)
    out["total"] = sum(out.values())
    return out


def byte_floor_speedup(name: str, schedule: SparsitySchedule, attention: SparseAttentionConfig, batch: int, lo: int,
                       hi: int) -> float:
    """Σ dense bytes / Σ sparse bytes of the decode steps at contexts lo..hi (every block-size-th one): the
    protocol's speedup if both modes ran at the memory floor. A measured speedup above it is impossible."""
    model = DecoderModel(spec_for_shape(name), attention.block_size, device="meta", dtype=DTYPE)
    dense = sparse = 0
    for context in range(lo, hi + 1, attention.block_size):
        dense += step_bytes(model, attention, batch, context, None)["total"]
        sparse += step_bytes(model, attention, batch, context, schedule.blocks_attended(context))["total"]
    return dense / sparse


# --------------------------------------------------------------------------------- filled decode


class FilledDecode:
    """`batch` sequences whose KV cache (every layer) and landmarks hold random values up to `max_len`
    tokens; each block table is a random slice of the pool, as in a long-running engine. Decode steps at
    any context ≤ max_len replay from the engine's `DecodeGraphs`, then sample (T = 1, top-20 logprobs)."""

    def __init__(self, model: DecoderModel, attention: SparseAttentionConfig, batch: int, max_len: int, seed: int = 0):
        from sparrow.kernels.triton import TritonBackend

        bs = attention.block_size
        self.model, self.attention, self.batch = model, attention, batch
        self.max_blocks = blocks_for(max_len, bs)
        num_blocks = batch * self.max_blocks + 1
        need = num_blocks * bytes_per_block(model.spec, attention, model.dtype)
        free = free_gpu_memory()
        if need > 0.97 * free:
            raise ValueError(f"{batch} sequences of {max_len} tokens need {need / 1e9:.1f} GB of KV cache, "
                             f"{free / 1e9:.1f} GB are free; lower the batch or the length")
        self.cache = KVCache(model.spec, attention, num_blocks, model.dtype, model.device)
        gen = torch.Generator(device=model.device).manual_seed(seed)
        for t in (self.cache.k, self.cache.v, self.cache.landmarks):
            t.normal_(generator=gen)
        self.graphs = DecodeGraphs(model, self.cache, TritonBackend(), attention, batch, self.max_blocks)
        cpu = torch.Generator().manual_seed(seed)
        perm = torch.randperm(num_blocks, generator=cpu)
        self.tables = [perm[r * self.max_blocks : (r + 1) * self.max_blocks].tolist() for r in range(batch)]
        for row, table in enumerate(self.tables):
            self.graphs.write_table(row, table)
        self.token_ids = torch.randint(0, model.spec.vocab_size, (batch,), generator=cpu).tolist()
        params = [SamplingParams(temperature=1.0, logprobs=20)] * batch
        self.sampling = SamplingBatch.build(params, list(range(batch)), [max_len] * batch, model.device)

    def use_model(self, model: DecoderModel) -> None:
        """Decode with another model of the same shape over the same filled cache (new graphs)."""
        from sparrow.kernels.triton import TritonBackend

        self.graphs = DecodeGraphs(model, self.cache, TritonBackend(), self.attention, self.batch, self.max_blocks)
        for row, table in enumerate(self.tables):
            self.graphs.write_table(row, table)
        gc.collect()

    def stage(self, context: int, sparse: bool) -> DecodeStep:
        bs = self.attention.block_size
        current = [t[(context - 1) // bs] for t in self.tables]
        return self.graphs.stage(list(range(self.batch)), self.token_ids, [context] * self.batch, current, sparse)

    def time(self, context: int, sparse: bool, replays: int) -> dict:
        """Median ms of the graph replay, of the sampler after it, and of both, over `replays` steps."""
        step = self.stage(context, sparse)
        step.replay()
        sample(step.logits[: self.batch], self.sampling)
        torch.cuda.synchronize()
        marks = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(replays)]
        for start, mid, end in marks:
            start.record()
            step.replay()
            mid.record()
            sample(step.logits[: self.batch], self.sampling)
            end.record()
        torch.cuda.synchronize()

        def median(values):
            return sorted(values)[len(values) // 2]

        return {"step_ms": median([s.elapsed_time(m) for s, m, _ in marks]),
                "sample_ms": median([m.elapsed_time(e) for _, m, e in marks]),
                "total_ms": median([s.elapsed_time(e) for s, _, e in marks])}

    def release(self) -> None:
        del self.graphs, self.cache
        gc.collect()
        torch.cuda.empty_cache()


def profile_kernels(step: DecodeStep, top: int = 12) -> dict:
    """Kernels of one replay (CUPTI sees the kernels inside a graph): count, summed GPU time, the largest."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step.replay()
        torch.cuda.synchronize()
    kernels = [k for k in prof.key_averages() if k.device_type == DeviceType.CUDA]

    def us(k):
        return getattr(k, "self_device_time_total", None) or getattr(k, "self_cuda_time_total", 0.0)

    kernels.sort(key=us, reverse=True)
    return {"kernels": sum(k.count for k in kernels), "kernel_us": sum(us(k) for k in kernels),
            "top": [{"name": k.key[:90], "count": k.count, "us": us(k)} for k in kernels[:top]]}


# -------------------------------------------------------------------------------- decode-step


def run_decode_step(model_name: str = "qwen3-1.7b", batch: int = 8, contexts=(16384, 24576, 32768),
                    budget_tokens: int = 1024, replays: int = 50, out_path: Path | None = None, command: str = "",
                    log=print) -> dict:
    from sparrow.kernels.triton.bench import copy_bandwidth

    _require_cuda("decode-step")
    out_path = out_path or default_out_path("decode-step")
    attention = SparseAttentionConfig()
    bs = attention.block_size
    if budget_tokens % bs or budget_tokens < bs * attention.reserved_blocks:
        raise ValueError(f"--budget-tokens {budget_tokens}: use a multiple of {bs} of at least {bs * attention.reserved_blocks}")
    budget = budget_tokens // bs
    report = _device_report(command)
    copy_gbps = copy_bandwidth()
    max_len = max(contexts) + 1
    spec = spec_for_shape(model_name)
    model = DecoderModel(spec, max_len + bs, device=DEVICE, dtype=DTYPE).init_random(0)
    log(f"{report['device']}: copy {copy_gbps:.0f} GB/s; {model_name} ({spec.num_layers} layers), batch {batch}, "
        f"budget {budget} blocks ({budget_tokens} tokens incl. sink + recent), weights {weight_bytes(model) / 1e9:.2f} GB")
    filled = FilledDecode(model, attention, batch, max_len)
    schedule = SparsitySchedule(name=f"budget-{budget}", topk_blocks=(budget - attention.reserved_blocks,), edges=())
    filled.graphs.set_schedule(schedule)
    report.update(model=model_name, batch=batch, budget_blocks=budget, copy_GBps=copy_gbps, replays=replays,
                  weights_bytes=weight_bytes(model), results=[], profiles={})
    points = [(bs, False)] + [(c, s) for c in contexts for s in (False, True)]
    for past, sparse in points:
        context = past + 1
        t = filled.time(context, sparse, replays)
        nbytes = step_bytes(model, attention, batch, context, budget if sparse else None)
        floor_ms = nbytes["total"] / copy_gbps / 1e6
        row = {"past_kv": past, "mode": "sparse" if sparse else "dense", **t, "bytes": nbytes, "floor_ms": floor_ms,
               "pct_copy": 100 * floor_ms / t["step_ms"], "paper_ms": PAPER_STEP_MS.get(past) if sparse else None}
        report["results"].append(row)
        log(f"past KV {past}: {row['mode']} step {t['step_ms']:.3f} ms + sampler {t['sample_ms']:.3f} ms "
            f"(floor {floor_ms:.3f} ms, {row['pct_copy']:.0f}% of copy)")
        _write(report, out_path, lambda *_: None)
    profiled = ((max(contexts), True), (max(contexts), False), (bs, False))
    for past, sparse in profiled:
        key = f"{past}-{'sparse' if sparse else 'dense'}"
        try:
            report["profiles"][key] = profile_kernels(filled.stage(past + 1, sparse))
            p = report["profiles"][key]
            log(f"profile {key}: {p['kernels']} kernels, {p['kernel_us'] / 1e3:.3f} ms of kernel time")
        except Exception as exc:  # the profiler is a diagnostic: its failure must not lose the timings
            report["profiles"][key] = {"error": repr(exc)}
    # ablation: the same steps with the plain (unfused) model — separate q/k/v, gate/up GEMMs, eager norm/RoPE/SiLU
    report["unfused"] = []
    del model
    filled.use_model(DecoderModel(spec, max_len + bs, device=DEVICE, dtype=DTYPE, fuse=False).init_random(0))
    filled.graphs.set_schedule(schedule)
    for past, sparse in profiled:
        t = filled.time(past + 1, sparse, replays)
        report["unfused"].append({"past_kv": past, "mode": "sparse" if sparse else "dense", **t})
        log(f"unfused model, past KV {past}: {'sparse' if sparse else 'dense'} step {t['step_ms']:.3f} ms")
    filled.release()
    _write(report, out_path, log)
    log(render_decode_step(report))
    return report


def render_decode_step(report: dict) -> str:
    rows = []
    for r in report["results"]:
        rows.append([r["past_kv"], r["mode"], f"{r['step_ms']:.3f}", f"{r['sample_ms']:.3f}", f"{r['total_ms']:.3f}",
                     f"{r['floor_ms']:.3f}", f"{r['pct_copy']:.0f}", "-" if r["paper_ms"] is None else f"{r['paper_ms']:.2f}"])
    head = (f"{report['model']}, batch {report['batch']}, budget {report['budget_blocks']} blocks, {report['device']}, "
            f"copy {report['copy_GBps']:.0f} GB/s, median of {report['replays']} graph replays")
    table = format_table(["past KV", "mode", "step ms", "sampler ms", "step+sampler ms", "floor ms", "% of copy",
                          "paper ms"], rows)
    fused = {(r["past_kv"], r["mode"]): r["step_ms"] for r in report["results"]}
    ablation = [[u["past_kv"], u["mode"], f"{u['step_ms']:.3f}", f"{fused[(u['past_kv'], u['mode'])]:.3f}"]
                for u in report.get("unfused", [])]
    if ablation:
        table += "\nfusion ablation (step ms):\n" + format_table(["past KV", "mode", "unfused model", "fused model"], ablation)
    return head + "\n" + table


# ------------------------------------------------------------------------------- rollout-paper


def free_gpu_memory() -> int:
    """Free device memory once everything unreferenced is released (PyTorch's cache included)."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def protocol_batch(model: DecoderModel, attention: SparseAttentionConfig, max_len: int, samples: int,
                   memory_fraction: float) -> int:
    """The most sequences, in whole groups of `samples`, whose `max_len`-token KV fits in
    `memory_fraction` of the free memory (what a continuous-batching engine would keep running)."""
    per_seq = blocks_for(max_len, attention.block_size) * bytes_per_block(model.spec, attention, model.dtype)
    fits = int(memory_fraction * free_gpu_memory() // per_seq)
    if fits < samples:
        raise ValueError(f"one group of {samples} sequences of {max_len} tokens does not fit ({fits} sequences do)")
    return fits // samples * samples


def regimes(schedule: SparsitySchedule | None, lo: int, hi: int, dense_every: int = 4096,
            extra_cuts=()) -> list[tuple[int, int]]:
    """Split contexts [lo, hi] into ranges on which the decode step's time is linear in the context:
    the budget, the dense/sparse choice and the block-table width bucket are constant inside each."""
    cuts = {lo, hi + 1, *[c for c in extra_cuts if lo < c <= hi]}
    bs = 16
    k = 16
    while k * bs + 1 <= hi:  # width buckets change when the block count passes a power of two
        cuts.add(k * bs + 1)
        k *= 2
    if schedule is None:
        cuts.update(range(lo + dense_every, hi + 1, dense_every))
    else:
        for i in range(schedule.num_bins):
            first, _ = schedule.bin_range(i)
            cuts.add(first)
            budget = schedule.blocks_for_bin(i)
            if budget is not None:
                cuts.add(budget * bs + 1)  # from here the row no longer fits its budget
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
        sparse = schedule is not None and (schedule.blocks_attended(context) is not None)
        out[context] = filled.time(context, sparse, replays)["total_ms"]
    return out


def real_rollout(engine, prompts, samples: int, gen_len: int, time_cap_s: float) -> dict:
    """One generation of `prompts` × `samples` (ignore EOS, T = 1, top-20 logprobs), step by step, stopped
    (and marked truncated) once `time_cap_s` has passed."""
    requests = [RolloutRequest(f"p{i}", p, SamplingParams(max_tokens=gen_len, temperature=1.0, seed=i, n=samples,
                                                          ignore_eos=True, logprobs=20))
                for i, p in enumerate(prompts)]
    before = engine.stats()
    start = time.perf_counter()
    for r in requests:
        if engine.add_request(r):
            raise RuntimeError(f"request {r.request_id} was refused by the engine")
    truncated = False
    step_s = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - t0)
        if time.perf_counter() - start > time_cap_s:
            engine.abort()
            truncated = True
            break
    wall = time.perf_counter() - start
    after = engine.stats()
    d = {k: after[k] - before[k] for k in ("prefill_seconds", "decode_seconds", "decode_tokens", "decode_steps",
                                           "tokens_generated")}
    ordered = sorted(step_s)
    return {**d, "wall_s": wall, "truncated": truncated, "median_step_ms": 1e3 * ordered[len(ordered) // 2],
            "last_step_ms": 1e3 * step_s[-1],  # the step that finishes the samples (gathers their outputs)
            "decode_tok_s": d["decode_tokens"] / d["decode_seconds"],
            "total_tok_s": d["tokens_generated"] / (d["prefill_seconds"] + d["decode_seconds"])}


def run_model(name: str, schedules: list[str], real_prompt: int, real_gen: int, project_prompt: int,
              project_gen: int, samples: int, memory_fraction: float, time_cap_s: float, replays: int, log) -> dict:
    from .config import NativeEngineConfig
    from .engine import NativeEngine

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
        num_kv_blocks=batch * blocks_for(real_len + 1, bs) + 2 * batch, max_model_len=real_len + bs,
        prefill_chunk_size=max(2048, real_prompt)), model=model)
    schedule = load_schedule(schedules[0])
    engine.set_schedule(schedule)
    if engine.stats()["cuda_graphs"]:
        engine.capture_decode_graphs([batch], real_len)
    prompts = [tuple(torch.randint(0, spec.vocab_size, (real_prompt,), generator=gen).tolist()) for _ in range(groups)]
    for mode in (None, schedule):  # warm-up: prefill and sampler kernels
        engine.set_schedule(mode)
        real_rollout(engine, prompts, samples, 2, time_cap_s)
    for label, mode in (("dense", None), ("sparse", schedule)):
        engine.set_schedule(mode)
        res = real_rollout(engine, prompts, samples, real_gen, time_cap_s)
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
    dense_ranges = regimes(None, lo, hi, extra_cuts=cuts)
    dense_times = measure_step_times(filled, None, dense_ranges, replays)
    out["projection"]["dense_points_ms"] = dense_times
    prefill_s = groups * project_prompt / prefill_rate
    for sched_name in schedules:
        sched = load_schedule(sched_name)
        ranges = regimes(sched, lo, hi, extra_cuts=cuts)
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
        entry["protocol"]["byte_floor_speedup"] = byte_floor_speedup(name, sched, attention, batch, proj_lo, proj_hi)
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
    _require_cuda("rollout-paper")
    out_path = out_path or default_out_path("rollout-paper")
    schedules = schedules or {}
    report = _device_report(command)
    report.update(real_prompt=real_prompt, real_gen=real_gen, project_prompt=project_prompt, project_gen=project_gen,
                  samples=samples, memory_fraction=memory_fraction, models=[])
    for name in models:
        names = schedules.get(name) or default_schedules(name)
        report["models"].append(run_model(name, names, real_prompt, real_gen, project_prompt, project_gen, samples,
                                          memory_fraction, time_cap_s, replays, log))
        _write(report, out_path, lambda *_: None)
    _write(report, out_path, log)
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


def main(argv: list[str] | None = None) -> int:
    """`python -m sparrow.rollout_workers.native.bench decode-step|rollout-paper ...` (the CLI without its other commands)."""
    import argparse

    from sparrow.cli.bench_cmd import register_decode_step, register_rollout_paper

    parser = argparse.ArgumentParser(prog="python -m sparrow.rollout_workers.native.bench")
    actions = parser.add_subparsers(dest="action", required=True)
    register_decode_step(actions)
    register_rollout_paper(actions)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
