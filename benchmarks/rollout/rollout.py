"""`sparrow bench rollout`: dense vs block-sparse rollout throughput of the native engine, measured end to end.

Both modes in one process (`--mode both`), or one mode per invocation (`--mode dense|sparse`; the same
`--seed` gives the same prompts and sampling seeds) with `--out` files that `sparrow bench rollout-merge`
joins, so that a 32K-token run of each mode fits one 10-minute GPU job. `--replayed N` (CUDA) then times
the engine's graph-replayed decode step (model + sampler, a filled cache, the same batch) at N contexts of
the run: the real step's host overhead over the replayed one, per context.

`--tensor-parallel N` runs the engine split over N ranks, one process each (one GPU each on CUDA, NCCL; gloo on
the CPU), in lockstep; rank 0 reports. On CUDA its decode steps run from CUDA graphs with the all-reduces
captured (`--no-cuda-graphs` decodes eagerly).

`--model` is an HF directory (real weights) or a shape name (`sparrow cost` shapes such as qwen3-1.7b, plus
smollm2-135m and tiny) with random weights. Prompts are random token ids and samples ignore EOS, so every
sample decodes exactly `--gen-len` tokens.

`--start-step N` measures the run from decode step N on (`real_run.segment_requests`), `--end-step M` up to step M - 1:
when even one mode outlasts a job, its segments run in separate jobs and `rollout-merge` joins them
(`real_run.join_segments`); `--segments K` runs K such segments at once, one process (and GPU) each, and joins them.
"""

import datetime
import faulthandler
import json
import os
import signal
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from sparrow.layout import SparseAttentionConfig
from sparrow.schedule import SparsitySchedule, load_schedule
from sparrow.tables import format_table

from .common import bench_command
from .real_run import (common_steps_speedup, join_segments, protocol_prompts, protocol_requests, real_rollout,
                       replay_windows, segment_bounds, segment_requests, sparse_step)

MODES = ("dense", "sparse")
RUN_KEYS = ("model", "device", "device_name", "dtype", "backend", "cuda_graphs", "overlap_decode", "sampler",
            "kv_cache_dtype", "landmark", "tensor_parallel", "all_reduce", "prompt_len", "gen_len", "batch", "samples",
            "seed", "schedule")
"""What two single-mode results must share to be merged into one comparison."""
SPARE_BLOCKS = 16
TEARDOWN_GRACE_S = 15.0
"""Seconds tensor-parallel ranks get to exit once their results are written. On 2 and 4 x H200, NCCL ranks that
decoded from CUDA graphs never exited, even through `os._exit` after destroying their process group (stuck past
Python, in the process exit); a rank that exits at all does so within seconds of its report."""
STALL_DUMP_S = 120.0
"""Seconds without progress after which a tensor-parallel rank prints its stacks."""


def bench_schedule(schedule_name: str, budget: int | None) -> SparsitySchedule:
    return load_schedule(schedule_name) if budget is None else SparsitySchedule.fixed_budget(budget, "--budget")


def bench_layout(args) -> SparseAttentionConfig:
    """The layout a run uses: Sparrow's, with the block summary `--landmark` names."""
    return SparseAttentionConfig(landmark=args.landmark)


def largest_batch(model, layout: SparseAttentionConfig, total: int, samples: int, memory_fraction: float,
                  kv_cache_dtype: str = "auto") -> int:
    """`--batch auto`: the most whole groups of `samples` whose `total`-token KV fits the free GPU memory."""
    from .rollout_paper import protocol_batch

    if model.device.type != "cuda":
        raise ValueError("--batch auto sizes the batch from free GPU memory; give a number on the CPU")
    return protocol_batch(model, layout, total, samples, memory_fraction, kv_cache_dtype)


def build_engine(args, model, batch: int):
    from sparrow.rollout_workers.native.config import NativeEngineConfig
    from sparrow.rollout_workers.native.engine import NativeEngine

    total = args.prompt_len + args.gen_len
    layout = bench_layout(args)
    config = NativeEngineConfig(
        device=str(model.device), dtype=args.dtype, attention_backend=args.attention_backend, max_num_seqs=batch,
        cuda_graphs=False if args.no_cuda_graphs else None, tensor_parallel_size=args.tensor_parallel,
        symmetric_memory_all_reduce=not args.nccl_all_reduce,
        overlap_decode=args.overlap_decode, fused_sampling=not args.eager_sampler, kv_cache_dtype=args.kv_cache_dtype,
        landmark=layout.landmark,
        num_kv_blocks=batch * layout.blocks_for(total + 1) + SPARE_BLOCKS,
        max_model_len=min(total + layout.block_size, model.rope.cos.shape[0]),
        prefill_chunk_size=max(2048, args.prompt_len),
    )
    engine = NativeEngine(config, model=model)
    if engine.stats()["cuda_graphs"]:
        engine.capture_decode_graphs([batch], total + 1)  # no capture inside the timed run
    return engine


def replayed_steps(model, layout: SparseAttentionConfig, batch: int, total: int, schedule: SparsitySchedule | None,
                   profile: list[dict], points: int, replays: int = 20, kv_cache_dtype: str = "auto") -> list[dict]:
    """The real run's median step in `points` windows of its profile next to the graph-replayed step (model +
    sampler) at the window's middle context on a filled cache of the same batch."""
    from .filled import FilledDecode, free_gpu_memory
    from .rollout_paper import measure_step_times

    picks = replay_windows(profile, schedule, points)
    contexts = [(w["first_context"] + w["last_context"]) // 2 for w in picks]
    free_gpu_memory()
    filled = FilledDecode(model, layout, batch, total + 1, kv_cache_dtype=kv_cache_dtype)
    times = measure_step_times(filled, schedule, [(c, c) for c in contexts], replays)
    filled.release()
    return [{"context": c, "path": "sparse" if sparse_step(schedule, c) else "dense",
             "real_ms": w["median_ms"], "replayed_ms": times[c], "real_over_replayed": w["median_ms"] / times[c]}
            for c, w in zip(contexts, picks)]


def run(args) -> dict:
    """Measure the modes `args.mode` names; returns the report (`--out` writes it as JSON)."""
    from sparrow.rollout_workers.native.model_loader import resolve_device

    device = resolve_device(args.device)
    if args.replayed and (device.type != "cuda" or args.no_cuda_graphs or args.tensor_parallel > 1):
        raise ValueError("--replayed compares against the engine's single-GPU CUDA graphs: run on --device cuda with "
                         "graphs on and --tensor-parallel 1")
    if args.segments > 1:
        return measure_in_segments(args, device)
    if args.tensor_parallel == 1:
        return measure(args, device)
    from sparrow.rollout_workers.native.shapes import model_spec
    from sparrow.rollout_workers.native.tensor_parallel import check_size

    try:
        check_size(model_spec(args.model), args.tensor_parallel)
    except ValueError as exc:
        raise ValueError(f"--tensor-parallel: {exc}") from None
    if device.type == "cuda" and torch.cuda.device_count() < args.tensor_parallel:
        raise ValueError(f"--tensor-parallel={args.tensor_parallel} needs one GPU a rank; this machine has "
                         f"{torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory(prefix="sparrow-tp-") as workdir:
        report = Path(workdir) / "report.json"
        run_ranks(_rank_main, (args, device.type, workdir), args.tensor_parallel, [report])
        return json.loads(report.read_text())


def measure_in_segments(args, device: torch.device) -> dict:
    """`--segments K`: the run's decode steps split into K ranges of about equal time (`segment_bounds`), measured at
    once, one process each (GPU k for segment k on CUDA), then joined as `rollout-merge` joins separate segments."""
    import copy

    stop = args.gen_len - 1 if args.end_step is None else args.end_step
    bounds = segment_bounds(args.start_step, stop, args.segments, args.prompt_len, args.mode)
    if device.type == "cuda" and torch.cuda.device_count() < args.segments:
        raise ValueError(f"--segments={args.segments} needs one GPU a segment; this machine has "
                         f"{torch.cuda.device_count()}")
    print("segments (decode steps): " + ", ".join(f"{a}-{b - 1}" for a, b in bounds), file=sys.stderr, flush=True)
    plans = [copy.copy(args) for _ in bounds]
    for plan, (start, end) in zip(plans, bounds):
        plan.segments, plan.start_step, plan.end_step = 1, start, end
    with tempfile.TemporaryDirectory(prefix="sparrow-segments-") as workdir:
        outs = [Path(workdir) / f"segment-{k}.json" for k in range(len(plans))]
        run_ranks(_segment_main, (plans, device.type, workdir), len(plans), outs)
        reports = [json.loads(out.read_text()) for out in outs]
    joined = merge(reports, [f"segment {k}" + (f" on cuda:{k}" if device.type == "cuda" else "") for k in range(len(plans))])
    del joined["commands"]  # one command made every segment: the report stays a single run that rollout-merge takes
    return {**joined, "command": reports[0]["command"], "date": reports[0]["date"]}


def _process_device(rank: int, device_type: str) -> torch.device:
    """The device of spawned process `rank`: GPU `rank` (made current) on CUDA, else the CPU."""
    if device_type != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    return device


def _segment_main(rank: int, plans: list, device_type: str, workdir: str) -> None:
    """One segment of `--segments`: its own process, GPU and engine; its report goes to `workdir`."""
    args = plans[rank]
    device = _process_device(rank, device_type)
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // len(plans)))
    report = measure(args, device)
    staged = Path(workdir) / f"segment-{rank}.json.part"
    staged.write_text(json.dumps(report))
    staged.rename(Path(workdir) / f"segment-{rank}.json")


def run_ranks(target, target_args: tuple, nprocs: int, done: list[Path], grace_s: float = TEARDOWN_GRACE_S) -> None:
    """Run `target(rank, *target_args)` in `nprocs` spawned processes until they exit, or until `grace_s` after
    every file in `done` exists (the ranks' results are written and they hang in their teardown): then their
    stacks go to stderr and they are killed, and the results are kept. A rank's exception is raised here."""
    import torch.multiprocessing as mp

    ranks = mp.start_processes(target, args=target_args, nprocs=nprocs, join=False, start_method="spawn")
    finished_at = None
    while not ranks.join(timeout=1.0):
        if finished_at is None and all(path.exists() for path in done):
            finished_at = time.monotonic()
        if finished_at is not None and time.monotonic() - finished_at > grace_s:
            _stop_ranks(ranks.processes, grace_s)
            return


def _stop_ranks(processes, grace_s: float) -> None:
    print(f"spawned processes (tensor-parallel ranks or segments) still running {grace_s:.0f} s after writing their "
          "results (process-group or CUDA teardown); their Python stacks follow (none: stuck past Python, in the process exit), then they "
          "are killed", file=sys.stderr, flush=True)
    for proc in processes:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGUSR1)
    time.sleep(2.0)
    for proc in processes:
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)


def _rank_main(rank: int, args, device_type: str, workdir: str) -> None:
    """One tensor-parallel rank: its own process, device and engine; rank 0 writes the report.

    A rank that makes no progress for STALL_DUMP_S seconds (no decode window, no phase done) prints every
    thread's stack to stderr, again every STALL_DUMP_S, so a rank stuck in a collective shows where."""
    from torch import distributed as dist

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    faulthandler.dump_traceback_later(STALL_DUMP_S, repeat=True)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = _process_device(rank, device_type)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{workdir}/rendezvous",
                            rank=rank, world_size=args.tensor_parallel)
    try:
        report = measure(args, device)
        faulthandler.dump_traceback_later(STALL_DUMP_S, repeat=True)
        if rank == 0:
            staged = Path(workdir) / "report.json.part"
            staged.write_text(json.dumps(report))
            staged.rename(Path(workdir) / "report.json")
    finally:
        dist.destroy_process_group()
        faulthandler.cancel_dump_traceback_later()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skips the interpreter's teardown, where NCCL ranks that ran CUDA graphs hung (run_ranks: backstop)


def measure(args, device: torch.device) -> dict:
    """The measurement in this process: the whole engine, or one tensor-parallel rank's (rank 0 prints)."""
    from sparrow.rollout_workers.native.model_loader import resolve_dtype
    from sparrow.rollout_workers.native.shapes import build_model

    from .filled import free_gpu_memory

    dtype = resolve_dtype(args.dtype, device)
    total = args.prompt_len + args.gen_len
    try:
        model = build_model(args.model, device, dtype, total, args.seed, args.tensor_parallel)
    except ValueError as exc:
        raise ValueError(f"{exc} (--prompt-len + --gen-len = {total}, --tensor-parallel {args.tensor_parallel})") from None
    tp = model.tensor_parallel
    free_after_model = free_gpu_memory() if device.type == "cuda" else None
    batch = (largest_batch(model, bench_layout(args), total, args.samples, args.memory_fraction, args.kv_cache_dtype)
             if args.batch == "auto"
             else int(args.batch))
    if tp is not None:  # every rank must run the same batch: the smallest any rank's memory holds
        batch = tp.smallest(batch, device)
    if batch % args.samples:
        raise ValueError(f"--batch={batch} is not a multiple of --samples={args.samples}")
    schedule = bench_schedule(args.schedule, args.budget)
    engine = build_engine(args, model, batch)
    prompts = protocol_prompts(model.spec.vocab_size, batch // args.samples, args.prompt_len, args.seed)
    agree = None if tp is None else (lambda passed: tp.smallest(int(not passed), device) == 0)
    prints = tp is None or tp.rank == 0
    modes = [(m, None if m == "dense" else schedule) for m in (MODES if args.mode == "both" else (args.mode,))]
    for _, sched in modes:  # warm-up of each mode's kernels (Triton compiles on first use)
        engine.set_schedule(sched)
        real_rollout(engine, protocol_requests(prompts, args.samples, 2, args.seed))
    results: dict[str, dict] = {}
    stop = args.gen_len if args.end_step is None else args.end_step + 1  # tokens per sample: prefill's + the steps
    for _ in range(args.repeats):
        for mode, sched in modes:
            engine.set_schedule(sched)
            progress = partial(_progress, mode, args.start_step, stop - 1, prints, tp is not None)
            requests = segment_requests(prompts, args.samples, stop, args.start_step, model.spec.vocab_size, args.seed)
            res = real_rollout(engine, requests, args.time_cap, progress, agree)
            res["truncated"] |= stop < args.gen_len
            if mode not in results or res["decode_tok_s"] > results[mode]["decode_tok_s"]:
                results[mode] = res
    stats = engine.stats()
    memory = gpu_memory(device, free_after_model)
    del engine
    if args.replayed:
        for mode, sched in modes:
            results[mode]["replayed"] = replayed_steps(model, bench_layout(args), batch, total, sched,
                                                       results[mode]["step_profile"], args.replayed,
                                                       kv_cache_dtype=args.kv_cache_dtype)
    report = {
        "command": bench_command("rollout"), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": args.model, "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "backend": stats["attention_backend"], "cuda_graphs": stats["cuda_graphs"],
        "kv_cache_dtype": stats["kv_cache_dtype"], "landmark": args.landmark,
        "overlap_decode": args.overlap_decode, "sampler": stats["sampler"],
        "tensor_parallel": args.tensor_parallel, "all_reduce": stats["all_reduce"],
        "prompt_len": args.prompt_len, "gen_len": args.gen_len, "batch": batch, "samples": args.samples, "seed": args.seed,
        "schedule": schedule.name, "start_step": args.start_step, "end_step": args.end_step, "modes": results,
        "byte_floor_speedup": protocol_byte_floor(args, batch, schedule), "gpu_memory": memory,
    }
    return with_speedup(report)


def gpu_memory(device: torch.device, free_after_model: int | None) -> dict | None:
    """What the run held on its GPU, taken while the engine still exists: the evidence that a batch fits (the
    device's memory in use counts the CUDA context and the libraries' workspaces, which PyTorch's peak omits)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    return {"total_gb": total / 1e9, "free_after_model_gb": free_after_model / 1e9,
            "used_gb": (total - free) / 1e9, "peak_reserved_gb": torch.cuda.max_memory_reserved(device) / 1e9}


def protocol_byte_floor(args, batch: int, schedule: SparsitySchedule) -> float:
    """The whole protocol's sparse / dense speedup if both modes moved only the bytes they must (`byte_floor_speedup`
    over its decode steps' contexts): the bound a measured ratio is read against, for segments and whole runs alike."""
    from sparrow.rollout_workers.native.shapes import model_spec

    from .floor import byte_floor_speedup

    return byte_floor_speedup(model_spec(args.model), schedule, bench_layout(args), batch, args.prompt_len + 1,
                              args.prompt_len + args.gen_len - 1, args.kv_cache_dtype)


def _progress(mode: str, first: int, steps: int, prints: bool, watched: bool, done: int, seconds: float) -> None:
    if prints:
        print(f"  {mode}: {first + done}/{steps} decode steps, {seconds:.1f} s", file=sys.stderr, flush=True)
    if watched:
        faulthandler.dump_traceback_later(STALL_DUMP_S, repeat=True)


def with_speedup(report: dict) -> dict:
    modes = report["modes"]
    if all(m in modes for m in MODES):
        report["decode_speedup"] = modes["sparse"]["decode_tok_s"] / modes["dense"]["decode_tok_s"]
        report["total_speedup"] = modes["sparse"]["total_tok_s"] / modes["dense"]["total_tok_s"]
        if any(modes[m]["truncated"] for m in MODES):
            report["common_steps_speedup"] = common_steps_speedup(modes["dense"]["step_profile"],
                                                                  modes["sparse"]["step_profile"])
    return report


def merge(reports: list[dict], names: list[str]) -> dict:
    """Single-mode reports of the same run settings joined into one comparison; a mismatch names the key. A mode
    given in several segments (`--start-step`) is joined into one run; every mode must start at the same step. A
    report that is itself a merge keeps its list of commands."""
    first = reports[0]
    own = ("modes", "command", "commands", "date", "start_step", "end_step", "decode_speedup", "total_speedup",
           "common_steps_speedup", "gpu_memory")
    merged = {**{k: v for k, v in first.items() if k not in own},
              "commands": [], "modes": {}}
    parts: dict[str, list[tuple[int, dict, str]]] = {}
    for report, name in zip(reports, names):
        for key in RUN_KEYS:
            if report.get(key) != first.get(key):
                raise ValueError(f"{name}: {key}={report.get(key)!r} but {names[0]} has {first.get(key)!r}; "
                                 f"merge only runs of the same settings (one mode each)")
        start = report.get("start_step", 0)
        for mode, result in report["modes"].items():
            if any(s == start for s, _, _ in parts.get(mode, [])):
                raise ValueError(f"{name}: mode {mode!r} from step {start} is already in another file; give each mode "
                                 f"once per segment")
            parts.setdefault(mode, []).append((start, result, name))
        merged["commands"] += report.get("commands") or [{"command": report["command"], "date": report.get("date")}]
    firsts = {mode: min(s for s, _, _ in segs) for mode, segs in parts.items()}
    if len(set(firsts.values())) > 1:
        raise ValueError(f"the modes start at different decode steps ({firsts}); give each mode from the same step")
    for mode, segs in parts.items():
        merged["modes"][mode] = segs[0][1] if len(segs) == 1 else join_segments(segs, first["batch"])
    merged["start_step"] = min(firsts.values())
    held = [r["gpu_memory"] for r in reports if r.get("gpu_memory")]
    merged["gpu_memory"] = max(held, key=lambda m: m["used_gb"]) if held else None
    return with_speedup(merged)


def render(report: dict) -> str:
    modes = report["modes"]
    rows = [[mode if mode == "dense" else f"sparse ({report['schedule']})", f"{r['prefill_seconds']:.2f}",
             f"{r['decode_seconds']:.2f}", f"{r['decode_tok_s']:.1f}", f"{r['total_tok_s']:.1f}",
             f"{r['median_step_ms']:.2f}", f"{r['last_step_ms']:.2f}", "-" if r["mean_blocks"] is None else f"{r['mean_blocks']:.1f}",
             "yes" if r["truncated"] else "no"]
            for mode, r in modes.items()]
    threads = f", {report['threads']} threads" if report.get("threads") else ""
    tp = report.get("tensor_parallel", 1)
    ranks = f" x{tp} (tensor parallel, all-reduce: {report.get('all_reduce') or 'nccl'})" if tp > 1 else ""
    lines = [f"{report['model']} on {report['device_name']}{ranks}{threads} ({report['dtype']}, {report['backend']} attention"
             f"{', CUDA graphs' if report['cuda_graphs'] else ''}"
             f"{', FP8 KV pages' if report.get('kv_cache_dtype', 'auto') != 'auto' else ''}"
             f"{', int8 landmarks' if report.get('landmark') == 'mean_int8' else ''}"
             f"{', overlapped decode' if report.get('overlap_decode') else ''}"
             f"{', fused sampler' if report.get('sampler') == 'fused' else ''}), batch {report['batch']} "
             f"({report['batch'] // report['samples']} prompts x {report['samples']}), prompt {report['prompt_len']} "
             f"+ gen {report['gen_len']} tokens",
             format_table(["mode", "prefill s", "decode s", "decode tok/s", "total tok/s", "median step ms",
                           "last step ms", "blocks/token", "truncated"], rows)]
    if report.get("start_step") or report.get("end_step"):
        span = f"up to decode step {report['end_step'] - 1}" if report.get("end_step") else "on"
        lines.append(f"from decode step {report.get('start_step', 0)} {span} (other steps not measured here)")
    for mode, r in modes.items():
        if "segments" in r:
            spans = ", ".join(f"{seg['start_step']}-{seg['start_step'] + seg['steps'] - 1} from {seg['file']}"
                              for seg in r["segments"])
            lines.append(f"{mode}: joined from {len(r['segments'])} segments (decode steps {spans}); times from their "
                         f"step profiles")
    if "decode_speedup" in report:
        floor = report.get("byte_floor_speedup")
        lines.append(f"sparse / dense: decode {report['decode_speedup']:.2f}x, total {report['total_speedup']:.2f}x"
                     + ("" if floor is None else f" (byte floor {floor:.2f}x: both modes at the memory floor)"))
    memory = report.get("gpu_memory")
    if memory:
        lines.append(f"GPU memory: {memory['used_gb']:.1f} of {memory['total_gb']:.1f} GB in use with the engine "
                     f"(PyTorch's peak reservation {memory['peak_reserved_gb']:.1f} GB; "
                     f"{memory['free_after_model_gb']:.1f} GB were free after the weights)")
    common = report.get("common_steps_speedup")
    if common and common["speedup"]:
        lines.append(f"a run was truncated: over the first {common['steps']} decode steps both made, sparse / dense "
                     f"{common['speedup']:.2f}x ({common['dense_s']:.1f} s dense, {common['sparse_s']:.1f} s sparse)")
    replay_rows = [[mode, p["context"], p.get("path", "-"), f"{p['real_ms']:.3f}", f"{p['replayed_ms']:.3f}",
                    f"{p['real_over_replayed']:.3f}"] for mode, r in modes.items() for p in r.get("replayed", [])]
    if replay_rows:
        lines.append("real decode step (median of its window) vs the graph-replayed step + sampler:")
        lines.append(format_table(["mode", "context", "step path", "real ms", "replayed ms", "real / replayed"],
                                  replay_rows))
    return "\n".join(lines)


def write(report: dict, out: Path | None, as_json: bool) -> None:
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1))
        print(f"wrote {out}", file=sys.stderr)
    print(json.dumps(report) if as_json else render(report))
