"""`sparrow bench rollout ...`: dense vs block-sparse rollout throughput of the native engine, side by
side in one process on the same weights. A benchmark, not a test: it prints what it measured.

`--model` is an HF directory (real weights) or a shape name (`sparrow cost` shapes such as
qwen3-1.7b, plus smollm2-135m and tiny) built with random weights. Prompts are random token ids and
samples ignore EOS, so every sample decodes exactly `--gen-len` tokens.
"""

import json
from pathlib import Path

from sparrow.tables import format_table
from sparrow.trainer.cli import register as register_trainer


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: rollout throughput, decode step, decode kernel bandwidth, trainer step")
    actions = p.add_subparsers(dest="bench_command", metavar="ACTION", required=True)
    r = actions.add_parser("rollout", help="native engine: dense vs sparse decode tokens/s in one process")
    r.add_argument("--model", required=True, metavar="DIR_OR_SHAPE", help="HF directory, or a shape name (random weights)")
    r.add_argument("--prompt-len", type=int, required=True)
    r.add_argument("--gen-len", type=int, required=True)
    r.add_argument("--batch", type=int, required=True, help="sequences decoded together (prompts x samples)")
    sparse = r.add_mutually_exclusive_group()
    sparse.add_argument("--schedule", default="qwen3-4b-0.86", help="sparsity schedule name or file (default qwen3-4b-0.86)")
    sparse.add_argument("--budget", type=int, help="constant budget in blocks (sink + top-k + recent) instead of a schedule")
    r.add_argument("--samples", type=int, default=1, help="samples per prompt sharing its KV blocks; must divide --batch")
    r.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    r.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    r.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "reference", "triton"])
    r.add_argument("--no-cuda-graphs", action="store_true", help="decode with eager launches on CUDA (default: graphs)")
    r.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    r.add_argument("--repeats", type=int, default=1,
                   help="measure dense and sparse alternately this many times and keep each mode's fastest run")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--json", action="store_true", help="print the results as one JSON object")
    r.set_defaults(handler=run_rollout)
    register_kernels(actions)
    register_decode_step(actions)
    register_rollout_paper(actions)
    register_trainer(actions)


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

    from sparrow.rollout_workers.native.bench import run_decode_step as run

    if args.batch < 1 or args.replays < 1 or any(c < 16 for c in args.contexts):
        raise ValueError("--batch and --replays must be >= 1 and --contexts >= 16 tokens")
    run(args.model, args.batch, tuple(args.contexts), args.budget_tokens, args.replays,
        args.out, "sparrow " + " ".join(sys.argv[1:]))
    return 0


def run_rollout_paper(args) -> int:
    import sys

    from sparrow.rollout_workers.native.bench import run_rollout_paper as run
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


def register_kernels(actions) -> None:
    """`sparrow bench kernels`: the Triton decode kernels' bandwidth (logic in sparrow.kernels.triton.bench)."""
    k = actions.add_parser("kernels", help="decode attention kernels: achieved bandwidth vs the copy bandwidth (CUDA)")
    k.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 8 64)")
    k.add_argument("--contexts", type=int, nargs="+", help="context lengths in tokens (default 8192 16384 32768)")
    k.add_argument("--budgets", type=int, nargs="+", help="KV budgets in tokens, multiples of 16 (default 1024 2048 4096)")
    k.add_argument("--groups", type=int, nargs="+", help="query heads per KV head (default 2 4)")
    k.add_argument("--minmax-contexts", type=int, nargs="*", help="contexts also timed with min/max landmarks (default 32768)")
    k.add_argument("--no-sweep", action="store_true", help="skip the attention tiling / split-K sweep")
    k.add_argument("--rep-ms", type=int, help="do_bench time per measurement in ms (default 60)")
    k.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/kernels-<gpu>-<time>.json)")
    k.set_defaults(handler=run_kernels)


def run_kernels(args) -> int:
    import sys

    from sparrow.kernels.triton.bench import run_from_args

    run_from_args(args, "sparrow " + " ".join(sys.argv[1:]))
    return 0


def measure(engine, requests) -> dict:
    """One generate call: phase times from the engine's counters, and the mean blocks per token."""
    import torch

    before = engine.stats()
    samples = engine.generate(requests)
    after = engine.stats()
    delta = {k: after[k] - before[k] for k in ("prefill_seconds", "decode_seconds", "decode_tokens", "tokens_generated")}
    return {
        "prefill_s": delta["prefill_seconds"], "decode_s": delta["decode_seconds"],
        "decode_tok_s": delta["decode_tokens"] / delta["decode_seconds"],
        "total_tok_s": delta["tokens_generated"] / (delta["prefill_seconds"] + delta["decode_seconds"]),
        "mean_blocks": torch.cat([s.blocks_attended.float() for s in samples]).mean().item(),
        "errors": sum(s.error is not None for s in samples),
    }


def run_rollout(args) -> int:
    import torch

    from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
    from sparrow.rollout_workers.native import NativeEngine, NativeEngineConfig
    from sparrow.rollout_workers.native.model_loader import resolve_device, resolve_dtype
    from sparrow.rollout_workers.native.shapes import build_model
    from sparrow.layout import DEFAULT_LAYOUT
    from sparrow.schedule import SparsitySchedule, load_schedule

    for flag in ("prompt_len", "gen_len", "batch", "samples", "repeats"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}={getattr(args, flag)}: must be >= 1")
    if args.batch % args.samples:
        raise ValueError(f"--batch={args.batch} is not a multiple of --samples={args.samples}")
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads={args.threads}: must be >= 1")
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    total = args.prompt_len + args.gen_len
    try:
        model = build_model(args.model, device, dtype, total, args.seed)
    except ValueError as exc:
        raise ValueError(f"{exc} (--prompt-len + --gen-len = {total})") from None
    reserved = DEFAULT_LAYOUT.reserved_blocks
    if args.budget is not None:
        if args.budget < reserved:
            raise ValueError(f"--budget={args.budget}: must be >= {reserved} (sink + recent)")
        schedule = SparsitySchedule(name=f"budget-{args.budget}", topk_blocks=(args.budget - reserved,), edges=())
    else:
        schedule = load_schedule(args.schedule)
    spare_blocks = 16
    config = NativeEngineConfig(
        device=str(device), dtype=args.dtype, attention_backend=args.attention_backend, max_num_seqs=args.batch,
        cuda_graphs=False if args.no_cuda_graphs else None,
        num_kv_blocks=args.batch * DEFAULT_LAYOUT.blocks_for(total + 1) + spare_blocks,
        max_model_len=min(total + DEFAULT_LAYOUT.block_size, model.rope.cos.shape[0]),
        prefill_chunk_size=max(2048, args.prompt_len),
    )
    engine = NativeEngine(config, model=model)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.spec.vocab_size
    prompts = [tuple(torch.randint(0, vocab, (args.prompt_len,), generator=gen).tolist()) for _ in range(args.batch // args.samples)]

    def requests(max_tokens: int):
        return [RolloutRequest(f"p{i}", p, SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=args.seed + i,
                                                           n=args.samples, ignore_eos=True, logprobs=20))
                for i, p in enumerate(prompts)]

    modes = (("dense", None), ("sparse", schedule))
    for _, sched in modes:  # warm-up of each mode's kernels (Triton compiles on first use)
        engine.set_schedule(sched)
        engine.generate(requests(2))
    results = {}
    for _ in range(args.repeats):
        for mode, sched in modes:
            engine.set_schedule(sched)
            res = measure(engine, requests(args.gen_len))
            if mode not in results or res["decode_tok_s"] > results[mode]["decode_tok_s"]:
                results[mode] = res
    formats = {"prefill_s": "{:.2f}", "decode_s": "{:.2f}", "decode_tok_s": "{:.1f}", "total_tok_s": "{:.1f}",
               "mean_blocks": "{:.1f}"}
    rows = [[mode if sched is None else f"sparse ({sched.name})"] + [f.format(results[mode][k]) for k, f in formats.items()]
            for mode, sched in modes]
    ratio = results["sparse"]["decode_tok_s"] / results["dense"]["decode_tok_s"]
    info = {"model": args.model, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
            "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "backend": engine.stats()["attention_backend"], "cuda_graphs": engine.stats()["cuda_graphs"], "prompt_len": args.prompt_len, "gen_len": args.gen_len,
            "batch": args.batch, "samples": args.samples, "schedule": schedule.name, **results,
            "decode_speedup": ratio}
    if args.json:
        print(json.dumps(info))
        return 0
    threads = f", {info['threads']} threads" if info["threads"] else ""
    print(f"{args.model} on {info['device']}{threads} ({info['dtype']}, {info['backend']} attention), batch {args.batch} "
          f"({len(prompts)} prompts x {args.samples}), prompt {args.prompt_len} + gen {args.gen_len} tokens")
    print(format_table(["mode", "prefill s", "decode s", "decode tok/s", "total tok/s", "blocks/token"], rows))
    print(f"sparse / dense decode throughput: {ratio:.2f}x")
    return 0
