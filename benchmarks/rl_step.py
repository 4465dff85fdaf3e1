"""`sparrow bench rl-step`: whole RL steps of the real job, timed part by part; `rl-step-merge` sets modes side by side.

The job is `TrainingJob`, as `sparrow train` runs it (dispatcher, rollout worker, gRPC trajectory stream, DeepSpeed
trainer rank, publication, the placement's time-sharing), on a random-weight Hugging Face checkpoint of a model
shape (the tiny 2,048-token tokenizer, so a Qwen3-1.7B shape holds 1.41B parameters) and JSONL prompts of
`--prompt-tokens` tokens. Generation has a fixed length (`rollout.sampling.ignore_eos`), the controller is off,
and each sample is judged as truncated (reward 0), so a step's work depends only on the shape and the protocol.
One mode (dense, or the shape's schedule) per call: `rl-step-merge` joins the calls' JSON like `rollout-merge`.

Per step the table gives: rollout (waiting for the step's groups), recompute and update (the trainer's two
passes; an on-policy update, one mini-batch and one epoch, takes π_old and α from its own forward, so it has no
recompute), publication, the two colocated transitions, idle (the step's wall time outside all of those: collecting
the batch, dispatching, the coordinator's control) and, on CUDA, the GPU's busy fraction sampled by nvidia-smi
over the step. A step's wall time is the driver's call for it, dispatch of the next step included.
`--reference-rollout` then times the same engine settings and schedule decoding the run's peak batch at its mean
length with no tail, the like-for-like figure for the job's rollout tokens/s.
"""

import json
import random
import subprocess
import threading
import time
from pathlib import Path

from sparrow.coordinator.step_record import mean_known
from sparrow.tables import format_table

from .checkpoints import checkpoint_config, shape_checkpoint
from .result_files import default_out_path

KIND = "rl-step"


def register(actions) -> None:
    """Adds `rl-step` and `rl-step-merge` to `sparrow bench`'s actions."""
    p = actions.add_parser("rl-step", help="whole RL steps of the real job loop (random-weight shape, fixed-length generation)")
    p.add_argument("--shape", default="qwen3-1.7b", help="model shape (sparrow cost's shapes; random weights)")
    p.add_argument("--mode", required=True, choices=("dense", "sparse"), help="one mode per call (see rl-step-merge)")
    p.add_argument("--schedule", default=None, help="sparse mode's schedule (default: the shape's published 0.86 one)")
    p.add_argument("--engine", default="native", choices=("native", "vllm"),
                   help="rollout.engine (vllm: colocated starts it in sleep mode, which needs CUDA)")
    p.add_argument("--placement", default="colocated", choices=("colocated", "disaggregated"))
    p.add_argument("--weights-channel", default="auto", help="run.weights_channel (disaggregated on one GPU: object_store)")
    p.add_argument("--run-mode", default="sync", choices=("sync", "async"),
                   help="run.mode (async: staleness 1, rollouts overlap training; a colocated job is sync whatever)")
    p.add_argument("--pool-gpus", type=float, default=0.5,
                   help="GPUs per rollout worker and per trainer rank (0.5 + 0.5 share one GPU; 1 each: two GPUs)")
    p.add_argument("--prompts", type=int, default=1, help="prompts per step")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32768,
                   help="generated tokens per sample (always reached, unless --stop-at-eos)")
    p.add_argument("--stop-at-eos", action="store_true",
                   help="variable lengths: samples end when the random-weight model draws its EOS token, a fixed "
                        "chance per token (geometric lengths, capped at --max-tokens); the table's mean length says "
                        "what it was")
    p.add_argument("--partial-rollout", type=int, default=None, metavar="EXTRA",
                   help="run.partial_rollout with EXTRA groups in flight beyond --prompts (0, async: none, groups "
                        "interrupted and resumed at each version); off when not given")
    p.add_argument("--carry", default="resume", choices=("resume", "finish"), help="run.partial_rollout.carry")
    p.add_argument("--carry-staleness", type=int, default=None, metavar="N",
                   help="run.partial_rollout.max_staleness (default: the run's staleness + 1; more lets more spares carry)")
    p.add_argument("--close-after-s", type=float, default=None,
                   help="run.partial_rollout.close_after_s (a time budget a step; needs --partial-rollout)")
    p.add_argument("--steps", type=int, default=1, help="timed steps (the job is set to one more, so none checkpoints)")
    p.add_argument("--reference-rollout", action="store_true",
                   help="after the job, the same engine settings and schedule decode the run's peak batch at its mean "
                        "length, every sample to the end (no tail): the tokens/s the job's rollout is set beside")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--kv-cache-dtype", default="auto", help="rollout.native.kv_cache_dtype (fp8_e4m3: half the pages)")
    p.add_argument("--micro-batch-tokens", type=int, default=None, help="trainer micro-batch (default: one sample)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one key of the job's config after the flags above, as `sparrow train --set` does, "
                        "e.g. --set rollout.vllm.weight_update=memory (repeatable)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/sparrow-rl-step"),
                   help="where the checkpoint (reused by shape), prompts and run directory go")
    p.add_argument("--out", type=Path, help="JSON results (default benchmarks/results/rl-step-<device>-<time>.json)")
    p.set_defaults(handler=run_bench)
    m = actions.add_parser("rl-step-merge", help="join `bench rl-step` files (dense and sparse calls) into one comparison")
    m.add_argument("files", nargs="+", type=Path)
    m.add_argument("--out", type=Path, help="write the merged results as JSON here")
    m.set_defaults(handler=run_merge)


def write_prompts(model_dir: Path, path: Path, count: int, tokens: int, seed: int = 0) -> list[int]:
    """`count` JSONL prompts of about `tokens` tokens each (random ordinary tokens, decoded); their token counts."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ordinary = [i for i in range(len(tokenizer)) if i not in set(tokenizer.all_special_ids)]
    rng = random.Random(seed)
    rows, lengths = [], []
    for _ in range(count):
        text = tokenizer.decode([rng.choice(ordinary) for _ in range(tokens)])
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:tokens]
        text = tokenizer.decode(ids)
        rows.append({"prompt": text, "answer": "0"})
        lengths.append(len(tokenizer(text, add_special_tokens=False)["input_ids"]))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return lengths


def job_config(args, model_dir: Path, prompts_path: Path, run_root: Path) -> dict:
    """The job: one rollout worker and one trainer rank, sharing one GPU (or its halves when disaggregated)."""
    from sparrow.coordinator.config import budget_carry_limit
    from sparrow.layout import BLOCK_SIZE

    for flag, value in (("--close-after-s", args.close_after_s), ("--carry-staleness", args.carry_staleness)):
        if value is not None and args.partial_rollout is None:
            raise ValueError(f"{flag} {value} needs --partial-rollout EXTRA (a partial-rollout setting; EXTRA may be 0)")
    length = args.prompt_tokens + args.max_tokens + 64
    extra = args.partial_rollout or 0  # beside a step's fresh groups: its spares, or what a budget-closed step left
    in_flight = args.prompts + (extra if args.close_after_s is None else budget_carry_limit(args.prompts, extra))
    batch = in_flight * args.samples
    blocks = batch * (-(-length // BLOCK_SIZE) + 2)
    cuda = args.device == "cuda"
    share = args.pool_gpus if cuda else 0.0
    schedule = "dense" if args.mode == "dense" else (args.schedule or f"{args.shape}-0.86")
    return {
        "model": str(model_dir),
        "data": {"source": "jsonl", "path": str(prompts_path), "chat_template": False, "shuffle": False},
        "reward": {"type": "arithmetic", "truncated": 0.0},
        "rollout": {
            "engine": args.engine, "schedule": schedule, "speedup_probe_every": 0,
            "pool": {"size": 1, "cpus": 4 if cuda else 1, "gpus": share},
            args.engine: engine_section(args, model_dir, length, batch, blocks),
            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_tokens": args.max_tokens, "n": args.samples,
                         "ignore_eos": not args.stop_at_eos},
        },
        "trainer": {"pool": {"size": 1, "cpus": 4 if cuda else 1, "gpus": share}, "device": args.device,
                    "dtype": "bfloat16" if cuda else "float32", "zero_stage": 2, "gradient_checkpointing": True,
                    "micro_batch_tokens": args.micro_batch_tokens or length},
        "controller": {"enabled": False},
        "metrics": {"enabled": False},
        "run": {"steps": args.steps + 1, "prompts_per_step": args.prompts, "mode": args.run_mode,
                "placement": args.placement, "weights_channel": args.weights_channel, "checkpoint_every": 0,
                **({"partial_rollout": {"enabled": True, "extra_groups": args.partial_rollout, "carry": args.carry,
                                        "close_after_s": args.close_after_s, "max_staleness": args.carry_staleness}}
                   if args.partial_rollout is not None else {}),
                "out_dir": str(run_root), **({"cost_hardware": "h200"} if cuda else {})},
    }


def engine_section(args, model_dir: Path, length: int, batch: int, blocks: int) -> dict:
    """The rollout engine's settings for `blocks` KV blocks of `batch` sequences of `length` tokens. vLLM takes its
    KV budget in bytes (pages and landmarks, the native engine's count of them), starts in sleep mode when colocated
    (the placement needs it to give its memory back), and checks at start-up only for its share of the GPU."""
    cuda = args.device == "cuda"
    if args.engine == "native":
        return {"device": args.device, "attention_backend": "triton" if cuda else "torch", "max_model_len": length,
                "max_num_seqs": batch, "num_kv_blocks": blocks, "prefill_chunk_size": max(2048, args.prompt_tokens),
                "kv_cache_dtype": args.kv_cache_dtype}
    import torch

    from sparrow.rollout_workers.native.kv_cache import bytes_per_block
    from sparrow.rollout_workers.native.model_spec import spec_from_config
    from sparrow.rollout_workers.vllm_backend.config import VllmEngineConfig

    if args.kv_cache_dtype != "auto":
        raise ValueError(f"--kv-cache-dtype {args.kv_cache_dtype} with --engine vllm: the vLLM backend stores K/V in "
                         "the model's dtype; leave it auto")
    spec = spec_from_config(checkpoint_config(model_dir), str(model_dir / "config.json"))
    layout = VllmEngineConfig().layout()
    per_block = bytes_per_block(spec, layout, torch.bfloat16 if cuda else torch.float32)
    return {"max_model_len": length, "max_num_seqs": batch, "kv_cache_memory_bytes": max(blocks * per_block, 1 << 20),
            "sleep_mode": cuda and args.placement == "colocated",
            **({"engine_args": {"gpu_memory_utilization": 0.9 * args.pool_gpus}} if cuda else {})}


def reference_rollout(config, model_dir: Path, rows: list[dict], samples: int, prompt_tokens: int) -> dict:
    """What the job's engine does with no tail: its settings and schedule, the largest batch a steady step reached
    (whole groups; the samples it trained where the engine reported no batch), every sample decoding the steady
    steps' mean length, timed through the engine contract (`bench rollout-engine`'s clock). The job's rollout tokens/s
    over this is issue 46's like-for-like ratio."""
    from sparrow.rollout_workers import registry

    from .rollout.engine_run import timed_generate
    from .rollout.real_run import protocol_prompts, protocol_requests

    steady = steady_steps(rows)
    peak = max((r.get("peak_batch") or r.get("samples") or 0 for r in steady), default=0)
    lengths = [r["response_tokens_mean"] for r in steady if r.get("response_tokens_mean")]
    if not peak or not lengths:
        raise ValueError("--reference-rollout: the run recorded no peak batch or mean length to match")
    groups = max(1, round(peak / samples))
    length = max(2, round(sum(lengths) / len(lengths)))
    schedule = config.initial_schedule()  # started with it, as the job's workers start theirs
    settings = config.rollout.engine_config().model_copy(
        update={"model": str(model_dir), "schedule": None if schedule is None else schedule.to_dict()})
    vocab = checkpoint_config(model_dir)["vocab_size"]
    prompts = protocol_prompts(vocab, groups, prompt_tokens, seed=1)
    engine = registry.create_engine(config.rollout.engine, settings)
    try:
        engine.generate(protocol_requests(prompts, samples, 2))
        result = timed_generate(engine, protocol_requests(prompts, samples, length), None)
    finally:
        engine.shutdown()
    return {"batch": groups * samples, "gen_len": length, **result}


class GpuBusy:
    """nvidia-smi's utilization.gpu every 100 ms, on a thread: the GPU's busy fraction over any time window."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                      "-lms", "100", "-i", "0"], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.samples.append((time.perf_counter(), float(line) / 100.0))

    def fraction(self, start: float, end: float) -> float | None:
        inside = [u for t, u in self.samples if start <= t <= end]
        return sum(inside) / len(inside) if inside else None

    def close(self) -> None:
        self.proc.terminate()


def step_row(record, wall: float, busy: float | None) -> dict:
    """One step's parts (seconds) and shares of its wall time."""
    t, train = record.timing, record.train or {}
    parts = {"rollout": t.rollout_wait, "recompute": train.get("recompute/seconds"),
             "update": train.get("train/seconds", 0.0), "publish": t.publish, "to_train": t.to_train,
             "to_rollout": t.to_rollout}
    other_train = t.train - (parts["recompute"] or 0.0) - parts["update"]
    idle = wall - t.rollout_wait - t.train - t.publish - t.to_train - t.to_rollout
    return {"step": record.step, "wall_s": wall, **{f"{k}_s": v for k, v in parts.items()},
            "train_other_s": other_train, "idle_s": idle, "collect_s": t.collect,
            "publish_fraction": t.publish / wall, "idle_fraction": idle / wall, "gpu_busy": busy,
            "publish_channel": record.publish.channel, "publish_gb": record.publish.bytes / 1e9,
            "transitions": t.transitions, "samples": record.rollout.samples, "tokens": record.rollout.tokens,
            "rollout_tokens_per_s": record.rollout.tokens_per_s, "kv_read_fraction": record.rollout.kv_read_fraction,
            "prompt_tokens_mean": record.rollout.prompt_length_mean,
            "response_tokens_mean": record.rollout.response_length_mean,
            "response_tokens_max": record.rollout.response_length_max, "tail_share": record.rollout.tail_share,
            "busy_batch_fraction": record.rollout.busy_batch_fraction, "peak_batch": record.rollout.peak_batch,
            "carried_out": record.rollout.carried_out,
            "resumed_samples": record.rollout.resumed_samples, "stale_tokens": record.rollout.stale_tokens,
            "staleness": record.rollout.staleness_histogram}


COLUMNS = [("step", "step"), ("wall_s", "wall s"), ("rollout_s", "rollout"), ("recompute_s", "recompute"),
           ("update_s", "update"), ("publish_s", "publish"), ("to_train_s", "to train"), ("to_rollout_s", "to rollout"),
           ("idle_s", "idle"), ("publish_fraction", "publish %"), ("idle_fraction", "idle %"), ("gpu_busy", "GPU busy %"),
           ("tail_share", "tail %"), ("response_tokens_mean", "mean len"), ("carried_out", "carried")]


def _cell(key: str, value) -> str:
    if value is None:
        return "-"
    if key.endswith("fraction") or key in ("gpu_busy", "tail_share"):
        return f"{100 * value:.1f}"
    if key == "wall_s_per_1k_tokens":
        return f"{value:.3f}"
    return str(value) if isinstance(value, int) else f"{value:.2f}"


def step_table(rows: list[dict], label: str | None = None) -> str:
    head = ([] if label is None else ["mode"]) + [name for _, name in COLUMNS]
    body = [([] if label is None else [row.get("mode", label)]) + [_cell(k, row.get(k)) for k, _ in COLUMNS] for row in rows]
    return format_table(head, body)


def run_bench(args) -> int:
    from sparrow.coordinator.config import build_config, set_override
    from sparrow.coordinator.driver import TrainingJob
    from sparrow.coordinator.run_dir import RunDir
    from sparrow.schedule import published_schedules

    if args.steps < 1:
        raise ValueError(f"--steps {args.steps}: time at least one step")
    if args.mode == "sparse" and args.schedule is None and f"{args.shape}-0.86" not in published_schedules():
        raise ValueError(f"--mode sparse --shape {args.shape}: no published {args.shape}-0.86 schedule to default to; "
                         "give --schedule (a name from `sparrow schedule list`, e.g. qwen3-1.7b-0.86, or a file)")
    args.workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"[rl-step] building the {args.shape} checkpoint (random weights) ...", flush=True)
    model_dir = shape_checkpoint(args.shape, args.workdir, args.device)
    prompts_path = args.workdir / f"prompts-{args.prompts}x{args.prompt_tokens}.jsonl"
    prompt_tokens = write_prompts(model_dir, prompts_path, args.prompts, args.prompt_tokens)
    run_root = args.workdir / "runs"
    data = job_config(args, model_dir, prompts_path, run_root)
    for assignment in args.set:
        set_override(data, assignment)
    config = build_config(data, "bench rl-step" + (" with --set overrides" if args.set else ""))
    run_dir = RunDir.create(run_root, time.strftime(f"{args.mode}-{args.placement}-%Y%m%d-%H%M%S"))
    run_dir.config_file.write_text(config.dump())
    busy = GpuBusy() if args.device == "cuda" else None
    rows, startup, pools_startup, reference, engines = [], None, None, None, None
    out = args.out or default_out_path(_device_name(args.device), KIND)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        """The JSON so far, rewritten after every step: a run stopped by its command's time limit keeps its steps."""
        result = {"kind": KIND, "shape": args.shape, "mode": args.mode, "engine": args.engine, "placement": args.placement,
                  "run_mode": "sync" if config.run.synchronous else "async", "pool_gpus": args.pool_gpus,
                  "schedule": config.rollout.schedule if args.mode == "sparse" else None,
                  "device": _device_name(args.device), "prompts": args.prompts, "samples": args.samples,
                  "prompt_tokens": prompt_tokens, "max_tokens": args.max_tokens, "kv_cache_dtype": args.kv_cache_dtype,
                  "weights_channel": rows[0]["publish_channel"], "stop_at_eos": args.stop_at_eos,
                  "partial_rollout": args.partial_rollout,
                  "carry": args.carry if args.partial_rollout is not None else None,
                  "close_after_s": args.close_after_s, "carry_staleness": args.carry_staleness, "set": args.set,
                  "startup_s": startup, "pools_startup": pools_startup, "engine_stats": engines, "steps": rows,
                  "steps_asked": args.steps,
                  "reference_rollout": reference, "seconds": time.perf_counter() - started,
                  "run_dir": str(run_dir.path)}
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    try:
        t_start = time.perf_counter()
        with TrainingJob(config, run_dir, progress=False, log=lambda m: print(f"[job] {m}", flush=True)) as job:
            startup, pools_startup = time.perf_counter() - t_start, job.pools_startup
            print(f"[rl-step] job started in {startup:.1f} s ({args.placement}, {args.mode}, schedule "
                  f"{config.rollout.schedule})", flush=True)
            for _ in range(args.steps):
                a = time.perf_counter()
                (record,) = job.run(steps=1)
                b = time.perf_counter()
                rows.append(step_row(record, b - a, busy.fraction(a, b) if busy else None))
                save()
                print(step_table(rows[-1:]), flush=True)
            engines = job.fleet.broadcast("engine_stats")
            save()
            print(f"[rl-step] engine stats: {json.dumps(engines, default=str)}", flush=True)
    finally:
        if busy:
            busy.close()
    print(step_table(rows))
    if args.reference_rollout:
        print("[rl-step] reference rollout: the run's peak batch at its mean length, no tail ...", flush=True)
        reference = reference_rollout(config, model_dir, rows, args.samples, args.prompt_tokens)
        save()
        print(f"reference rollout: batch {reference['batch']} x {reference['gen_len']} tokens, "
              f"{reference['total_tok_s']:.1f} tokens/s")
    print(f"results: {out}")
    return 0


def _device_name(device: str) -> str:
    import torch

    return torch.cuda.get_device_name() if device == "cuda" else "cpu"


def steady_steps(steps: list[dict]) -> list[dict]:
    """The steps after step 0 (the engine's and trainer's warm-up), or step 0 when a run timed only that one."""
    return steps[1:] or steps


def merge(results: list[dict]) -> dict:
    """Mean step parts per (placement, mode) over the steady steps (step 0, with the engine's and trainer's
    warm-up, is left out when a run timed more), and each placement's dense/sparse speedup of the step: per step,
    and per trained token, which is the fair one when lengths end at EOS and differ between runs."""
    for r in results:
        if r.get("kind") != KIND:
            raise ValueError(f"{r.get('kind')!r}: not a `bench rl-step` result")
    keys = {(r["shape"], r["prompts"], r["samples"], r["max_tokens"]) for r in results}
    if len(keys) > 1:
        raise ValueError(f"results of different protocols (shape, prompts, samples, max_tokens): {sorted(keys)}")
    rows = []
    for r in results:
        steady = steady_steps(r["steps"])
        tokens = [s.get("tokens") for s in steady]
        per_k = (1000 * sum(s["wall_s"] for s in steady) / sum(tokens)) if all(tokens) else None
        waited = sum(s["rollout_s"] for s in steady)
        rows.append({"placement": _placement(r), "mode": r["mode"], "steps": len(steady),
                     "warmup_excluded": len(steady) < len(r["steps"]), "wall_s_per_1k_tokens": per_k,
                     "run_tokens_per_s": sum(tokens) / waited if all(tokens) and waited > 0 else None,
                     "peak_batch": max((s.get("peak_batch") or 0 for s in steady), default=0) or None,
                     "reference_tokens_per_s": (r.get("reference_rollout") or {}).get("total_tok_s"),
                     **{k: mean_known([s.get(k) for s in steady]) for k, _ in COLUMNS if k != "step"}})
    speedups = {}
    for placement in sorted({r["placement"] for r in rows}):
        by_mode = {r["mode"]: r for r in rows if r["placement"] == placement}
        if {"dense", "sparse"} <= set(by_mode):
            d, s = by_mode["dense"], by_mode["sparse"]
            per_token = None if None in (d["wall_s_per_1k_tokens"], s["wall_s_per_1k_tokens"]) else (
                d["wall_s_per_1k_tokens"] / s["wall_s_per_1k_tokens"])
            speedups[placement] = {"step": d["wall_s"] / s["wall_s"], "rollout": d["rollout_s"] / s["rollout_s"],
                                   "step_per_token": per_token}
    return {"kind": f"{KIND}-merge", "protocol": dict(zip(("shape", "prompts", "samples", "max_tokens"), keys.pop())),
            "rows": rows, "speedups": speedups}


def _placement(result: dict) -> str:
    """The placement, the run mode when not sync, KV pages when not the model's dtype, the engine when not native,
    partial rollouts when on: the rows a dense/sparse pair is matched within."""
    mode = result.get("run_mode", "sync")
    label = result["placement"] if mode == "sync" else f"{result['placement']} {mode}"
    pages = result.get("kv_cache_dtype", "auto")
    label += "" if pages == "auto" else f" {pages} pages"
    engine = result.get("engine", "native")
    label += "" if engine == "native" else f" {engine}"
    extra = result.get("partial_rollout")
    off = extra is None or result.get("carry") is None  # results before `--partial-rollout 0` stored 0 for off
    if off:
        return label
    budget, bound = result.get("close_after_s"), result.get("carry_staleness")
    return (f"{label} partial+{extra} {result['carry']}" + ("" if budget is None else f" close {budget:g}s")
            + ("" if bound is None else f" staleness {bound}"))


def run_merge(args) -> int:
    merged = merge([json.loads(f.read_text()) for f in args.files])
    head = (["placement", "mode", "steps"] + [name for k, name in COLUMNS if k != "step"]
            + ["s / 1K tok", "tok/s rollout", "peak batch", "tok/s no tail"])
    body = [[r["placement"], r["mode"], f"{r['steps']}{' (after step 0)' if r['warmup_excluded'] else ''}"]
            + [_cell(k, r.get(k)) for k, _ in COLUMNS if k != "step"]
            + [_cell(k, r.get(k)) for k in ("wall_s_per_1k_tokens", "run_tokens_per_s", "peak_batch",
                                            "reference_tokens_per_s")]
            for r in merged["rows"]]
    print(format_table(head, body))
    for placement, s in merged["speedups"].items():
        per_token = "" if s["step_per_token"] is None else f"; per trained token {s['step_per_token']:.2f}x"
        print(f"{placement}: RL step {s['step']:.2f}x faster sparse (rollout {s['rollout']:.2f}x{per_token})")
    for r in merged["rows"]:
        if r["run_tokens_per_s"] and r["reference_tokens_per_s"]:
            print(f"{r['placement']} {r['mode']}: the rollout ran at {r['run_tokens_per_s'] / r['reference_tokens_per_s']:.0%} "
                  "of the same engine's tokens/s with no tail (--reference-rollout)")
    if args.out:
        args.out.write_text(json.dumps(merged, indent=1) + "\n")
    return 0
