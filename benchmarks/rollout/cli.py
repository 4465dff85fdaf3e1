"""The options of `sparrow bench rollout`, `rollout-merge`, `decode-step` and `rollout-paper` (the CLI registers
them; the benches import the engine only when chosen; decode-step and rollout-paper need CUDA)."""

from pathlib import Path

from sparrow.layout import BLOCK_SIZE, KV_CACHE_DTYPES, LANDMARK_MODES

LANDMARK_HELP = "block summary: mean key (default), minmax (Quest), mean_int8 (the mean key in int8 + a float32 scale)"


def register_rollout(actions) -> None:
    r = actions.add_parser("rollout", help="native engine: dense vs sparse rollout tokens/s, end to end")
    r.add_argument("--model", required=True, metavar="DIR_OR_SHAPE", help="HF directory, or a shape name (random weights)")
    r.add_argument("--prompt-len", type=int, required=True)
    r.add_argument("--gen-len", type=int, required=True)
    r.add_argument("--batch", required=True, metavar="N|auto",
                   help="sequences decoded together (prompts x samples); auto = the most groups whose KV fits the GPU")
    sparse = r.add_mutually_exclusive_group()
    sparse.add_argument("--schedule", default="qwen3-4b-0.86", help="sparsity schedule name or file (default qwen3-4b-0.86)")
    sparse.add_argument("--budget", type=int, help="constant budget in blocks (sink + top-k + recent) instead of a schedule")
    r.add_argument("--mode", default="both", choices=["both", "dense", "sparse"],
                   help="modes to run in this process (one per invocation fits long runs in a time limit; see rollout-merge)")
    r.add_argument("--samples", type=int, default=1, help="samples per prompt sharing its KV blocks; must divide --batch")
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    r.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    r.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "reference", "triton"])
    r.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="K/V pages: auto = the model's dtype; fp8_e4m3 halves them (and doubles --batch auto)")
    r.add_argument("--landmark", default="mean", choices=LANDMARK_MODES, help=LANDMARK_HELP)
    r.add_argument("--no-cuda-graphs", action="store_true", help="decode with eager launches on CUDA (default: graphs)")
    r.add_argument("--overlap-decode", action="store_true",
                   help="launch each decode step before reading the previous one's tokens (NativeEngineConfig.overlap_decode)")
    r.add_argument("--eager-sampler", action="store_true",
                   help="sample with the PyTorch ops on CUDA too (default: the fused kernel, "
                        "NativeEngineConfig.fused_sampling)")
    r.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    r.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the engine over N ranks, one process (and GPU) each, in lockstep (default 1)")
    r.add_argument("--nccl-all-reduce", action="store_true",
                   help="with --tensor-parallel on CUDA: every all-reduce over NCCL (default: decode steps' through "
                        "symmetric memory, NativeEngineConfig.symmetric_memory_all_reduce)")
    r.add_argument("--repeats", type=int, default=1, help="run the modes alternately this many times; keep each one's fastest")
    r.add_argument("--time-cap", type=float, default=None, help="seconds after which a run stops (marked truncated)")
    r.add_argument("--start-step", type=int, default=0, metavar="N",
                   help="measure from decode step N on (a multiple of 512): each sample's prompt carries N random tokens "
                        "of its own in place of its first N generated ones; rollout-merge joins such segments")
    r.add_argument("--segments", type=int, default=1, metavar="K",
                   help="measure the run as K segments at once, one process (and GPU) each, and join them: a run "
                        "K times shorter in wall time (boundaries balance the steps' growing cost)")
    r.add_argument("--end-step", type=int, default=None, metavar="M",
                   help="stop after decode step M - 1 (a multiple of 512; marked truncated): with --start-step, a "
                        "segment that ends exactly where the next one starts")
    r.add_argument("--memory-fraction", type=float, default=0.9, help="share of free GPU memory --batch auto fills")
    r.add_argument("--replayed", type=int, default=0, metavar="POINTS",
                   help="CUDA: time the graph-replayed step at this many contexts of the run (real vs replayed; "
                        "windows whose steps all take one path, dense or sparse)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", type=Path, help="write the results as JSON here")
    r.add_argument("--json", action="store_true", help="print the results as one JSON object")
    r.set_defaults(handler=run_rollout)


def register_rollout_merge(actions) -> None:
    m = actions.add_parser("rollout-merge", help="join single-mode `bench rollout --out` files into one comparison")
    m.add_argument("files", nargs="+", type=Path, help="JSON files written by `bench rollout --mode dense|sparse --out`")
    m.add_argument("--out", type=Path, help="write the merged results as JSON here")
    m.add_argument("--json", action="store_true", help="print the merged results as one JSON object")
    m.set_defaults(handler=run_rollout_merge)


def register_decode_step(actions) -> None:
    d = actions.add_parser("decode-step", help="full-model decode step at Sparrow's Table 4 points (CUDA graphs)")
    d.add_argument("--model", default="qwen3-1.7b", help="shape name (random bf16 weights; default qwen3-1.7b)")
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--contexts", type=int, nargs="+", default=[16384, 24576, 32768], help="past KV tokens per sequence")
    d.add_argument("--budget-tokens", type=int, default=1024, help="sparse budget incl. sink + recent (default 1024)")
    d.add_argument("--replays", type=int, default=50, help="graph replays per point (median reported)")
    d.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help="K/V pages (default: bf16)")
    d.add_argument("--landmark", default="mean", choices=LANDMARK_MODES, help=LANDMARK_HELP)
    d.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/decode-step-<gpu>-<time>.json)")
    d.set_defaults(handler=run_decode_step)


def register_rollout_paper(actions) -> None:
    p = actions.add_parser(
        "rollout-paper",
        help="the paper's rollout protocol on one GPU: a real shorter run + a projection to 32K from measured steps",
    )
    p.add_argument("--models", nargs="+", default=["qwen3-1.7b", "qwen3-4b", "qwen3-8b"], help="shape names")
    p.add_argument("--schedules", nargs="+", metavar="MODEL=NAME[,NAME]",
                   help="schedules per model (default: <model>-0.86; qwen3-8b: 0.86 and 0.87)")
    p.add_argument("--real-prompt", type=int, default=1800, help="prompt tokens of the real run (default 1800)")
    p.add_argument("--real-gen", type=int, default=3072, help="tokens generated per sample in the real run")
    p.add_argument("--project-prompt", type=int, default=256, help="prompt tokens of the projected protocol")
    p.add_argument("--project-gen", type=int, default=32768, help="tokens generated per sample, projected (32K)")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--memory-fraction", type=float, default=0.95,
                   help="share of free GPU memory for the protocol's KV cache (sets the batch)")
    p.add_argument("--time-cap", type=float, default=90.0, help="seconds after which a real run is stopped")
    p.add_argument("--replays", type=int, default=5, help="graph replays per measured context (median)")
    p.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/rollout-paper-<gpu>-<time>.json)")
    p.set_defaults(handler=run_rollout_paper)


def run_rollout(args) -> int:
    from . import rollout

    for flag in ("prompt_len", "gen_len", "samples", "repeats", "tensor_parallel", "segments"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be >= 1")
    if args.batch != "auto" and not (args.batch.isdigit() and int(args.batch) >= 1):
        raise ValueError(f"--batch={args.batch}: give a number >= 1 or auto")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads={args.threads}: must be >= 1")
        import torch

        torch.set_num_threads(args.threads)
    if args.replayed < 0 or (args.time_cap is not None and args.time_cap <= 0):
        raise ValueError("--replayed must be >= 0 and --time-cap > 0")
    from .real_run import STEP_WINDOW

    if args.start_step % STEP_WINDOW or not 0 <= args.start_step < args.gen_len - 1:
        raise ValueError(f"--start-step={args.start_step}: use a multiple of {STEP_WINDOW} (the step-profile window) "
                         f"below --gen-len - 1 = {args.gen_len - 1}, the decode steps of a sample")
    if args.end_step is not None and (args.end_step % STEP_WINDOW
                                      or not args.start_step < args.end_step <= args.gen_len - 1):
        raise ValueError(f"--end-step={args.end_step}: use a multiple of {STEP_WINDOW} above --start-step="
                         f"{args.start_step} and at most --gen-len - 1 = {args.gen_len - 1}")
    if args.segments > 1 and (args.tensor_parallel > 1 or args.time_cap is not None):
        raise ValueError(f"--segments={args.segments}: runs each segment on one GPU to its end; drop "
                         f"--tensor-parallel and --time-cap (a capped segment would leave a gap before the next)")
    if not 0 < args.memory_fraction <= 0.97:
        raise ValueError(f"--memory-fraction={args.memory_fraction}: use a value in (0, 0.97]")
    rollout.write(rollout.run(args), args.out, args.json)
    return 0


def run_rollout_merge(args) -> int:
    import json

    from . import rollout

    reports = []
    for path in args.files:
        try:
            reports.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: not a readable `bench rollout --out` JSON file ({exc})") from None
    rollout.write(rollout.merge(reports, [str(p) for p in args.files]), args.out, args.json)
    return 0


def run_decode_step(args) -> int:
    from . import run_decode_step as run
    from .common import bench_command

    if args.batch < 1 or args.replays < 1 or any(c < BLOCK_SIZE for c in args.contexts):
        raise ValueError(f"--batch and --replays must be >= 1 and --contexts >= {BLOCK_SIZE} tokens")
    run(args.model, args.batch, tuple(args.contexts), args.budget_tokens, args.replays,
        args.out, bench_command("decode-step"), kv_cache_dtype=args.kv_cache_dtype, landmark=args.landmark)
    return 0


def run_rollout_paper(args) -> int:
    from . import run_rollout_paper as run
    from .common import bench_command
    from sparrow.schedule import load_schedule

    schedules = {}
    for item in args.schedules or []:
        model, sep, names = item.partition("=")
        if not sep or not names:
            raise ValueError(f"--schedules {item!r}: use MODEL=NAME[,NAME], e.g. qwen3-8b=qwen3-8b-0.87")
        schedules[model] = names.split(",")
        for name in schedules[model]:
            load_schedule(name)
    for flag in ("real_prompt", "real_gen", "project_prompt", "project_gen", "samples", "replays"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be >= 1")
    if not 0 < args.memory_fraction <= 0.97:
        raise ValueError(f"--memory-fraction={args.memory_fraction}: use a value in (0, 0.97]")
    run(tuple(args.models), schedules, args.real_prompt, args.real_gen, args.project_prompt, args.project_gen,
        args.samples, args.memory_fraction, args.time_cap, args.replays, args.out,
        bench_command("rollout-paper"))
    return 0
