"""`sparrow bench decode-step`: the full-model decode step at the points of Sparrow's Table 4."""

from pathlib import Path

from sparrow.bench.cuda_timing import copy_bandwidth
from sparrow.kernels import SparseAttentionConfig
from sparrow.rollout_workers.native.model import DecoderModel
from sparrow.rollout_workers.native.shapes import spec_for_shape
from sparrow.schedule import SparsitySchedule
from sparrow.tables import format_table

from .common import DEVICE, DTYPE, PAPER_STEP_MS, device_report, require_cuda, write_report, default_out_path
from .breakdown import step_breakdown
from .filled import FilledDecode, profile_kernels
from .floor import step_bytes, weight_bytes


def run_decode_step(model_name: str = "qwen3-1.7b", batch: int = 8, contexts=(16384, 24576, 32768),
                    budget_tokens: int = 1024, replays: int = 50, out_path: Path | None = None, command: str = "",
                    log=print, kv_cache_dtype: str = "auto", landmark: str = "mean") -> dict:
    require_cuda("decode-step")
    out_path = out_path or default_out_path("decode-step")
    attention = SparseAttentionConfig(landmark=landmark)
    bs = attention.block_size
    if budget_tokens % bs or budget_tokens < bs * attention.reserved_blocks:
        raise ValueError(f"--budget-tokens {budget_tokens}: use a multiple of {bs} of at least {bs * attention.reserved_blocks}")
    budget = budget_tokens // bs
    report = device_report(command)
    copy_gbps = copy_bandwidth()
    max_len = max(contexts) + 1
    spec = spec_for_shape(model_name)
    model = DecoderModel(spec, max_len + bs, device=DEVICE, dtype=DTYPE).init_random(0)
    log(f"{report['device']}: copy {copy_gbps:.0f} GB/s; {model_name} ({spec.num_layers} layers), batch {batch}, "
        f"budget {budget} blocks ({budget_tokens} tokens incl. sink + recent), "
        f"weights {weight_bytes(model) / 1e9:.2f} GB, KV pages {kv_cache_dtype}, landmarks {landmark}")
    filled = FilledDecode(model, attention, batch, max_len, kv_cache_dtype=kv_cache_dtype)
    schedule = SparsitySchedule.fixed_budget(budget, "--budget-tokens / block size")
    filled.graphs.set_schedule(schedule)
    report.update(model=model_name, batch=batch, budget_blocks=budget, kv_cache_dtype=kv_cache_dtype, landmark=landmark,
                  copy_GBps=copy_gbps, replays=replays,
                  weights_bytes=weight_bytes(model), results=[], profiles={})
    points = [(bs, False)] + [(c, s) for c in contexts for s in (False, True)]
    for past, sparse in points:
        context = past + 1
        t = filled.time(context, sparse, replays)
        nbytes = step_bytes(model, attention, batch, context, budget if sparse else None, kv_cache_dtype)
        floor_ms = nbytes["total"] / copy_gbps / 1e6
        row = {"past_kv": past, "mode": "sparse" if sparse else "dense", **t, "bytes": nbytes, "floor_ms": floor_ms,
               "pct_copy": 100 * floor_ms / t["step_ms"], "paper_ms": PAPER_STEP_MS.get(past) if sparse else None}
        report["results"].append(row)
        log(f"past KV {past}: {row['mode']} step {t['step_ms']:.3f} ms + sampler {t['sample_ms']:.3f} ms "
            f"(floor {floor_ms:.3f} ms, {row['pct_copy']:.0f}% of copy)")
        write_report(report, out_path, lambda *_: None)
    profiled = ((max(contexts), True), (max(contexts), False), (bs, False))
    for past, sparse in profiled:
        mode = "sparse" if sparse else "dense"
        key = f"{past}-{mode}"
        try:
            p = report["profiles"][key] = profile_kernels(filled.stage(past + 1, sparse))
            point = next(r for r in report["results"] if r["past_kv"] == past and r["mode"] == mode)
            p["breakdown"] = step_breakdown(p["kinds"], p["gap_us"], point["bytes"], copy_gbps)
            p["floor_us"] = point["floor_ms"] * 1e3
            log(f"profile {key}: {p['kernels']} kernels, {p['kernel_us'] / 1e3:.3f} ms of kernel time, "
                f"{p['gap_us'] / 1e3:.3f} ms idle between them over a {p['span_us'] / 1e3:.3f} ms span; most idle after: "
                + "; ".join(f"{g['before'][:24]} -> {g['after'][:24]} {g['us']:.0f} us ({g['count']}x)" for g in p["gaps"][:4]))
        except Exception as exc:  # the profiler is a diagnostic: its failure must not lose the timings
            report["profiles"][key] = {"error": repr(exc)}
    write_report(report, out_path, lambda *_: None)
    # ablation: the same steps with the plain (unfused) model — separate q/k/v, gate/up GEMMs, eager norm/RoPE/SiLU
    report["unfused"] = []
    need = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    free = filled.drop_model()  # one model's weights at a time: the largest batches leave no room for two
    if free < 1.1 * need:
        report["unfused_skipped"] = f"the unfused model needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB are free"
        log(f"fusion ablation skipped: {report['unfused_skipped']} (lower --batch to run it)")
        profiled = ()
    else:
        filled.use_model(DecoderModel(spec, max_len + bs, device=DEVICE, dtype=DTYPE, fuse=False).init_random(0))
        filled.graphs.set_schedule(schedule)
    for past, sparse in profiled:
        t = filled.time(past + 1, sparse, replays)
        report["unfused"].append({"past_kv": past, "mode": "sparse" if sparse else "dense", **t})
        log(f"unfused model, past KV {past}: {'sparse' if sparse else 'dense'} step {t['step_ms']:.3f} ms")
    filled.release()
    write_report(report, out_path, log)
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
    for key, profile in report.get("profiles", {}).items():
        if "breakdown" in profile:
            table += "\n" + render_breakdown(key, profile)
    return head + "\n" + table


def render_breakdown(key: str, profile: dict) -> str:
    """Where one profiled step goes (`breakdown.step_breakdown`), ending with its span against the step's floor."""
    floor_us = profile["floor_us"]
    rows = [[r["kind"], r["calls"] or "-", f"{r['us']:.0f}", f"{r['us'] / r['calls']:.1f}" if r["calls"] else "-",
             "-" if r["floor_us"] is None else f"{r['floor_us']:.0f}", f"{r['above_us']:.0f}"] for r in profile["breakdown"]]
    rows.append(["span", profile["kernels"], f"{profile['span_us']:.0f}", "-", f"{floor_us:.0f}",
                 f"{profile['span_us'] - floor_us:.0f}"])
    return (f"where the {key} step goes (one profiled replay):\n"
            + format_table(["kernels", "calls", "us", "us a call", "floor us", "above floor us"], rows))
