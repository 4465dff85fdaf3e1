"""`sparrow bench rollout-engine`: any registered rollout backend, dense against sparse, through the engine contract.

`bench rollout` times the native engine step by step from inside; a backend that runs its own loop (vLLM) shows only
its `RolloutEngine` contract. This bench uses nothing else: the benchmark protocol's requests (random prompts, every
sample decoding exactly `--gen-len` tokens at T = 1, EOS ignored) go to one `generate` call per mode, timed from the
call to its return, each mode warmed up first by a 2-token run of one sample as long as the measured ones (kernels
compile for these lengths, graphs capture). So the native engine and vLLM, on the same checkpoint and schedule, are
measured by the same clock and can stand side by side. (A warm-up on the short prompt alone left the long prefill's
kernels to compile inside the first mode's timed prefill: on 2026-12-06, H100, from step 24,576, the native dense
prefill read 12.5 s against sparse's 8.4 s for the same dense work, and the decode, the difference, came out 4 s short.)

Each mode's prefill is timed apart: the same requests for one token first, then the whole run; decode is the
difference (prefix caching is turned off for a backend that has it, so the second prefill is not a cache hit).
A run longer than one job is measured in segments, as `bench rollout` does: `--start-step N` gives every sample N
random tokens of its own in place of its first N generated ones, `--end-step M` stops it after decode step M - 1, and
`rollout-engine-merge` joins the segments' decode times into the run they stand for. `--time-cap S` instead
interrupts every request after S seconds (`RolloutEngine.interrupt`: the samples keep what they generated): the
figures then cover the part that ran and the result says it was truncated.
"""

import datetime
import json
import threading
import time
from dataclasses import replace
from pathlib import Path

import torch

from sparrow.tables import format_table

from ..checkpoints import checkpoint_config, shape_checkpoint
from ..result_files import default_out_path
from .common import bench_command
from .real_run import protocol_prompts, segment_requests

KIND = "rollout-engine"
MODES = ("dense", "sparse")


def checkpoint(model: str, workdir: Path, device: str) -> Path:
    """`model` as a directory, or a random-weight checkpoint of the shape it names."""
    path = Path(model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"--model {model}: a directory without config.json (give a Hugging Face model directory "
                             "or a shape name)")
        return path
    return shape_checkpoint(model, workdir, device)


def engine_settings(backend: str, model_dir: Path, batch: int, total: int, seed: int, device: str, overrides: dict):
    """The backend's own settings section: what the protocol fixes (model, batch, length, seed; `device`, and
    prefix caching off, for a backend whose section names them) under `overrides` (`--settings`, the section's fields
    by name; its validation names a bad one)."""
    from pydantic import ValidationError

    from sparrow.layout import BLOCK_SIZE
    from sparrow.rollout_workers import registry

    section = registry.config_class(backend)
    fields = section.model_fields
    fixed = {"model": str(model_dir), "max_num_seqs": batch, "max_model_len": total + BLOCK_SIZE, "seed": seed,
             **({"device": device} if "device" in fields else {}),
             **({"enable_prefix_caching": False} if "enable_prefix_caching" in fields else {})}
    try:
        return section.model_validate({**fixed, **overrides})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}={e.get('input')!r}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"--settings for the {backend} engine: {problems} (its fields: "
                         f"{', '.join(sorted(section.model_fields))})") from None


def timed_generate(engine, requests, time_cap_s: float | None) -> dict:
    """One `generate` call, timed; with a cap, every request is interrupted once it has passed."""
    timer = None
    if time_cap_s is not None:
        timer = threading.Timer(time_cap_s, lambda: [engine.interrupt(r.request_id) for r in requests])
        timer.daemon = True
    start = time.perf_counter()
    if timer is not None:
        timer.start()
    try:
        samples = engine.generate(requests)
    finally:
        if timer is not None:
            timer.cancel()
    wall = time.perf_counter() - start
    tokens = sum(int(s.token_ids.numel()) for s in samples)
    blocks = sum(float(s.blocks_attended.float().sum()) for s in samples if s.blocks_attended is not None)
    errors = [s.error for s in samples if s.error is not None]
    return {"samples": len(samples), "tokens_generated": tokens, "wall_s": wall,
            "total_tok_s": tokens / wall if wall > 0 else None,
            "mean_blocks": blocks / tokens if tokens else None,
            "truncated": any(s.finish_reason == "interrupted" for s in samples),
            "errors": len(errors), "first_error": errors[0] if errors else None}


def measure_mode(engine, requests, time_cap_s: float | None) -> dict:
    """The requests for one token (their prefill), then whole: decode is the difference, its tokens all but the
    first of each sample (which the prefill samples)."""
    first = [replace(r, sampling=replace(r.sampling, max_tokens=1)) for r in requests]
    prefill = timed_generate(engine, first, None)
    result = timed_generate(engine, requests, time_cap_s)
    decode_s = max(result["wall_s"] - prefill["wall_s"], 1e-9)
    decode_tokens = result["tokens_generated"] - result["samples"]
    return {**result, "prefill_s": prefill["wall_s"], "decode_s": decode_s, "decode_tokens": decode_tokens,
            "decode_tok_s": decode_tokens / decode_s}


def warmup_requests(prompts, start_step: int, vocab_size: int, seed: int):
    """One sample for 2 tokens, as long as the segment's samples: its prefill and decode compile the kernels these
    lengths need outside the timed runs. Its own tokens come from another seed than the measured samples', so no
    measured prompt is a prefix-cache hit on it."""
    return segment_requests(prompts[:1], 1, start_step + 2, start_step, vocab_size, seed + 1)


def run(args) -> dict:
    from sparrow.rollout_workers import registry

    from .rollout import bench_schedule

    for flag in ("prompt_len", "gen_len", "batch", "samples"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be >= 1")
    if args.batch % args.samples:
        raise ValueError(f"--batch={args.batch} is not a multiple of --samples={args.samples}")
    if args.time_cap is not None and args.time_cap <= 0:
        raise ValueError(f"--time-cap={args.time_cap}: must be > 0")
    stop = args.gen_len if args.end_step is None else args.end_step + 1
    if not 0 <= args.start_step < stop - 1 or stop > args.gen_len:
        raise ValueError(f"--start-step={args.start_step} --end-step={args.end_step}: a segment is 0 <= start < end <= "
                         f"--gen-len - 1 = {args.gen_len - 1} (decode steps)")
    if args.time_cap is not None and (args.start_step or args.end_step is not None):
        raise ValueError("--time-cap with --start-step/--end-step: a capped segment would leave a gap before the next; "
                         "drop one of them")
    try:
        overrides = json.loads(args.settings)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--settings {args.settings!r}: not JSON ({exc}); give an object, e.g. "
                         "'{\"kv_cache_dtype\": \"fp8_e4m3\"}'") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"--settings {args.settings!r}: give a JSON object of the backend's settings by name")
    total = args.prompt_len + args.gen_len
    schedule = bench_schedule(args.schedule, args.budget)
    model_dir = checkpoint(args.model, args.workdir, args.device)
    settings = engine_settings(args.engine, model_dir, args.batch, total, args.seed, args.device, overrides)
    vocab = checkpoint_config(model_dir)["vocab_size"]
    prompts = protocol_prompts(vocab, args.batch // args.samples, args.prompt_len, args.seed)
    modes = [(m, None if m == "dense" else schedule) for m in (MODES if args.mode == "both" else (args.mode,))]
    if any(sched is not None for _, sched in modes):
        # started sparse: an engine that fixes its kernels when it starts (vLLM's full decode graphs) runs as it began
        settings = settings.model_copy(update={"schedule": schedule.to_dict()})
    started = time.perf_counter()
    engine = registry.create_engine(args.engine, settings)
    startup = time.perf_counter() - started
    results = {}
    try:
        warmup = warmup_requests(prompts, args.start_step, vocab, args.seed)
        for _, sched in modes:
            engine.set_schedule(sched)
            engine.generate(warmup)
        for mode, sched in modes:
            engine.set_schedule(sched)
            print(f"[rollout-engine] {args.engine} {mode}: {args.batch} samples, tokens {args.start_step}-{stop - 1} "
                  f"of {args.gen_len} ...", flush=True)
            requests = segment_requests(prompts, args.samples, stop, args.start_step, vocab, args.seed)
            results[mode] = measure_mode(engine, requests, args.time_cap)
        stats = engine.stats()
    finally:
        engine.shutdown()
    report = {
        "kind": KIND, "command": bench_command(KIND),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "engine": args.engine, "model": args.model, "device": args.device,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "settings": settings.model_dump(mode="json"), "prompt_len": args.prompt_len, "gen_len": args.gen_len,
        "batch": args.batch, "samples": args.samples, "seed": args.seed, "schedule": schedule.name,
        "start_step": args.start_step, "end_step": args.end_step, "time_cap_s": args.time_cap, "startup_s": startup,
        "modes": results,
        "engine_stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool)) or v is None},
    }
    return with_speedup(report)


def with_speedup(report: dict) -> dict:
    dense, sparse = report["modes"].get("dense"), report["modes"].get("sparse")
    if dense and sparse and dense["decode_tok_s"] and sparse["decode_tok_s"]:
        report["speedup"] = sparse["decode_tok_s"] / dense["decode_tok_s"]
    return report


def render(report: dict) -> str:
    head = ["mode", "samples", "tokens", "prefill s", "decode s", "decode tok/s", "blocks/token", "truncated", "errors"]
    body = [[mode, r["samples"], r["tokens_generated"], f"{r['prefill_s']:.2f}", f"{r['decode_s']:.2f}",
             f"{r['decode_tok_s']:.1f}", "-" if r["mean_blocks"] is None else f"{r['mean_blocks']:.1f}",
             "yes" if r["truncated"] else "no", r["errors"]]
            for mode, r in report["modes"].items()]
    segment = "" if not report["start_step"] and report["end_step"] is None else (
        f", decode steps {report['start_step']}-{(report['end_step'] or report['gen_len'] - 1) - 1}")
    lines = [f"{report['engine']} engine, {report['model']} on {report['device_name']}: batch {report['batch']} "
             f"({report['batch'] // report['samples']} prompts x {report['samples']}), prompt {report['prompt_len']} + "
             f"gen {report['gen_len']} tokens{segment}, schedule {report['schedule']}", format_table(head, body)]
    if "speedup" in report:
        lines.append(f"sparse / dense: {report['speedup']:.2f}x decode tokens/s")
    errors = [r["first_error"] for r in report["modes"].values() if r.get("first_error")]
    if errors:
        lines.append(f"first error: {errors[0]}")
    return "\n".join(lines)


def run_bench(args) -> int:
    report = run(args)
    print(render(report))
    out = args.out or default_out_path(report["device_name"], KIND)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"results: {out}")
    return 1 if any(r["errors"] for r in report["modes"].values()) else 0


def register(actions) -> None:
    from sparrow.rollout_workers import registry

    r = actions.add_parser("rollout-engine", help="any rollout backend (native, vllm), dense vs sparse tokens/s through "
                                                  "the engine contract: the same clock for every backend")
    r.add_argument("--engine", default="native", choices=registry.names(), help="rollout backend (rollout.engine)")
    r.add_argument("--model", required=True, metavar="DIR_OR_SHAPE", help="HF directory, or a shape name (random weights)")
    r.add_argument("--prompt-len", type=int, required=True)
    r.add_argument("--gen-len", type=int, required=True)
    r.add_argument("--batch", type=int, required=True, help="sequences decoded together (prompts x samples)")
    r.add_argument("--samples", type=int, default=8, help="samples per prompt; must divide --batch")
    r.add_argument("--schedule", default="qwen3-1.7b-0.86", help="sparse mode's schedule (name or file)")
    r.add_argument("--budget", type=int, help="constant budget in blocks (sink + top-k + recent) instead of a schedule")
    r.add_argument("--mode", default="both", choices=["both", *MODES])
    r.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="the engine's device (a shape's checkpoint is bf16 on cuda); vLLM takes the GPU it sees")
    r.add_argument("--settings", default="{}", metavar="JSON",
                   help="the backend's settings by name, e.g. native: '{\"kv_cache_dtype\": \"fp8_e4m3\"}', vllm: "
                        "'{\"kv_cache_memory_bytes\": 60000000000}' (the protocol sets model, max_num_seqs, "
                        "max_model_len, seed, and the native engine's device)")
    r.add_argument("--start-step", type=int, default=0, metavar="N",
                   help="measure from decode step N on: each sample's prompt carries N random tokens of its own in "
                        "place of its first N generated ones (rollout-engine-merge joins segments)")
    r.add_argument("--end-step", type=int, default=None, metavar="M",
                   help="stop after decode step M - 1: with --start-step, a segment that ends where the next begins")
    r.add_argument("--time-cap", type=float, default=None, help="seconds after which every request is interrupted")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--workdir", type=Path, default=Path("/tmp/sparrow-rollout-engine"),
                   help="where a shape's checkpoint is built (reused)")
    r.add_argument("--out", type=Path, help="JSON results (default benchmarks/results/rollout-engine-<device>-<time>.json)")
    r.set_defaults(handler=run_bench)
    m = actions.add_parser("rollout-engine-merge", help="join `bench rollout-engine` segments (--start-step/--end-step) "
                                                        "into the runs they stand for")
    m.add_argument("files", nargs="+", type=Path)
    m.add_argument("--out", type=Path, help="write the joined report as JSON here")
    m.set_defaults(handler=run_merge)


PROTOCOL_KEYS = ("engine", "model", "prompt_len", "gen_len", "batch", "samples", "schedule", "device_name")


def merge(named: list[tuple[str, dict]]) -> dict:
    """Segments of one protocol, `(file name, report)`, joined per mode: decode steps must tile 0 .. gen_len - 1 with
    no gap or overlap; decode time and tokens add up, prefill is the first segment's (the protocol's own prompts)."""
    for name, report in named:
        if report.get("kind") != KIND:
            raise ValueError(f"{name}: not a `bench rollout-engine` result ({report.get('kind')!r})")
    protocols = {tuple(report[k] for k in PROTOCOL_KEYS) for _, report in named}
    if len(protocols) > 1:
        raise ValueError(f"segments of different runs ({', '.join(PROTOCOL_KEYS)}): {sorted(protocols)}")
    first_report = named[0][1]
    gen_len = first_report["gen_len"]
    modes = {}
    for mode in MODES:
        parts = sorted(((r["start_step"], r["end_step"], name, r["modes"][mode]) for name, r in named if mode in r["modes"]),
                       key=lambda part: part[0])
        if not parts:
            continue
        step = 0
        for start, end, name, result in parts:
            if start != step:
                raise ValueError(f"{mode}: {name} starts at decode step {start}, but the segments before it end at "
                                 f"{step}; run the missing steps with --start-step {step} --end-step {start}")
            if result["truncated"] or result["errors"]:
                raise ValueError(f"{mode}: {name} was cut short (time cap or errors): run it again")
            step = gen_len - 1 if end is None else end
        if step != gen_len - 1:
            raise ValueError(f"{mode}: the segments end at decode step {step}, short of {gen_len - 1}; run "
                             f"--start-step {step}")
        decode_s = sum(part[3]["decode_s"] for part in parts)
        decode_tokens = sum(part[3]["decode_tokens"] for part in parts)
        prefill_s = parts[0][3]["prefill_s"]
        tokens = first_report["batch"] * gen_len
        modes[mode] = {"samples": first_report["batch"], "tokens_generated": tokens, "prefill_s": prefill_s,
                       "decode_s": decode_s, "decode_tokens": decode_tokens, "decode_tok_s": decode_tokens / decode_s,
                       "wall_s": prefill_s + decode_s, "total_tok_s": tokens / (prefill_s + decode_s),
                       "mean_blocks": None, "truncated": False, "errors": 0,
                       "segments": [{"file": name, "start_step": start, "end_step": end} for start, end, name, _ in parts]}
    joined = {**{k: first_report[k] for k in (*PROTOCOL_KEYS, "kind", "device", "seed")}, "start_step": 0,
              "end_step": None, "modes": modes}
    return with_speedup(joined)


def run_merge(args) -> int:
    joined = merge([(str(f), json.loads(f.read_text())) for f in args.files])
    print(render(joined))
    for mode, result in joined["modes"].items():
        starts = ", ".join(str(seg["start_step"]) for seg in result["segments"])
        print(f"{mode}: joined from {len(result['segments'])} segments (from decode steps {starts})")
    if args.out:
        args.out.write_text(json.dumps(joined, indent=1) + "\n")
    return 0
