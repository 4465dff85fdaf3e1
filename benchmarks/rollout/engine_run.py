"""`sparrow bench rollout-engine`: any registered rollout backend, dense against sparse, through the engine contract.

`bench rollout` times the native engine step by step from inside; a backend that runs its own loop (vLLM) shows only
its `RolloutEngine` contract. This bench uses nothing else: the benchmark protocol's requests (random prompts, every
sample decoding exactly `--gen-len` tokens at T = 1, EOS ignored) go to one `generate` call per mode, timed from the
call to its return, each mode warmed up first by a 2-token run (kernels compile, graphs capture). So the native
engine and vLLM, on the same checkpoint and schedule, are measured by the same clock and can stand side by side.

`--time-cap S` interrupts every request after S seconds (`RolloutEngine.interrupt`: the samples keep what they
generated): the figures then cover the part that ran and the result says it was truncated.
"""

import datetime
import json
import threading
import time
from pathlib import Path

import torch

from sparrow.tables import format_table

from ..checkpoints import shape_checkpoint
from ..result_files import default_out_path
from .common import bench_command
from .real_run import protocol_prompts, protocol_requests

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
    """The backend's own settings section: what the protocol fixes (model, batch, length, seed; `device` for a
    backend whose section names one) under `overrides` (`--settings`, the section's fields by name; its validation
    names a bad one)."""
    from pydantic import ValidationError

    from sparrow.layout import BLOCK_SIZE
    from sparrow.rollout_workers import registry

    section = registry.config_class(backend)
    fixed = {"model": str(model_dir), "max_num_seqs": batch, "max_model_len": total + BLOCK_SIZE, "seed": seed,
             **({"device": device} if "device" in section.model_fields else {})}
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
    try:
        overrides = json.loads(args.settings)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--settings {args.settings!r}: not JSON ({exc}); give an object, e.g. "
                         "'{\"device\": \"cuda\"}'") from None
    if not isinstance(overrides, dict):
        raise ValueError(f"--settings {args.settings!r}: give a JSON object of the backend's settings by name")
    total = args.prompt_len + args.gen_len
    schedule = bench_schedule(args.schedule, args.budget)
    model_dir = checkpoint(args.model, args.workdir, args.device)
    settings = engine_settings(args.engine, model_dir, args.batch, total, args.seed, args.device, overrides)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = protocol_prompts(vocab, args.batch // args.samples, args.prompt_len, args.seed)
    modes = [(m, None if m == "dense" else schedule) for m in (MODES if args.mode == "both" else (args.mode,))]
    started = time.perf_counter()
    engine = registry.create_engine(args.engine, settings)
    startup = time.perf_counter() - started
    results = {}
    try:
        for _, sched in modes:
            engine.set_schedule(sched)
            engine.generate(protocol_requests(prompts, args.samples, 2, args.seed))
        for mode, sched in modes:
            engine.set_schedule(sched)
            print(f"[rollout-engine] {args.engine} {mode}: {args.batch} samples x {args.gen_len} tokens ...", flush=True)
            results[mode] = timed_generate(engine, protocol_requests(prompts, args.samples, args.gen_len, args.seed),
                                           args.time_cap)
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
        "time_cap_s": args.time_cap, "startup_s": startup, "modes": results,
        "engine_stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str, bool)) or v is None},
    }
    dense, sparse = results.get("dense"), results.get("sparse")
    if dense and sparse and dense["total_tok_s"] and sparse["total_tok_s"]:
        report["speedup"] = sparse["total_tok_s"] / dense["total_tok_s"]
    return report


def render(report: dict) -> str:
    head = ["mode", "samples", "tokens", "wall s", "tok/s", "blocks/token", "truncated", "errors"]
    body = [[mode, r["samples"], r["tokens_generated"], f"{r['wall_s']:.2f}",
             "-" if r["total_tok_s"] is None else f"{r['total_tok_s']:.1f}",
             "-" if r["mean_blocks"] is None else f"{r['mean_blocks']:.1f}", "yes" if r["truncated"] else "no", r["errors"]]
            for mode, r in report["modes"].items()]
    lines = [f"{report['engine']} engine, {report['model']} on {report['device_name']}: batch {report['batch']} "
             f"({report['batch'] // report['samples']} prompts x {report['samples']}), prompt {report['prompt_len']} + "
             f"gen {report['gen_len']} tokens, schedule {report['schedule']} (started in {report['startup_s']:.1f} s)",
             format_table(head, body)]
    if "speedup" in report:
        lines.append(f"sparse / dense: {report['speedup']:.2f}x tokens/s (the whole generate call, prefill included)")
    errors = [r["first_error"] for r in report["modes"].values() if r["first_error"]]
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
    r.add_argument("--time-cap", type=float, default=None, help="seconds after which every request is interrupted")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--workdir", type=Path, default=Path("/tmp/sparrow-rollout-engine"),
                   help="where a shape's checkpoint is built (reused)")
    r.add_argument("--out", type=Path, help="JSON results (default benchmarks/results/rollout-engine-<device>-<time>.json)")
    r.set_defaults(handler=run_bench)
