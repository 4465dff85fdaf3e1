"""The options of `sparrow bench decode-step` and `sparrow bench rollout-paper` (the CLI registers them; the
benches run only when chosen, on CUDA)."""

from pathlib import Path

from sparrow.layout import BLOCK_SIZE


def register_decode_step(actions) -> None:
    d = actions.add_parser("decode-step", help="full-model decode step at Sparrow's Table 4 points (CUDA graphs)")
    d.add_argument("--model", default="qwen3-1.7b", help="shape name (random bf16 weights; default qwen3-1.7b)")
    d.add_argument("--batch", type=int, default=8)
    d.add_argument("--contexts", type=int, nargs="+", default=[16384, 24576, 32768], help="past KV tokens per sequence")
    d.add_argument("--budget-tokens", type=int, default=1024, help="sparse budget incl. sink + recent (default 1024)")
    d.add_argument("--replays", type=int, default=50, help="graph replays per point (median reported)")
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


def run_decode_step(args) -> int:
    import sys

    from . import run_decode_step as run

    if args.batch < 1 or args.replays < 1 or any(c < BLOCK_SIZE for c in args.contexts):
        raise ValueError(f"--batch and --replays must be >= 1 and --contexts >= {BLOCK_SIZE} tokens")
    run(args.model, args.batch, tuple(args.contexts), args.budget_tokens, args.replays,
        args.out, "sparrow " + " ".join(sys.argv[1:]))
    return 0


def run_rollout_paper(args) -> int:
    import sys

    from . import run_rollout_paper as run
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
        "sparrow " + " ".join(sys.argv[1:]))
    return 0
