"""`sparrow bench rollout ...`: dense vs block-sparse rollout throughput of the native engine, side by
side in one process on the same weights. A benchmark, not a test: it prints what it measured.

`--model` is an HF directory (real weights) or a shape name (`sparrow cost` shapes such as
qwen3-1.7b, plus smollm2-135m and tiny) built with random weights. Prompts are random token ids and
samples ignore EOS, so every sample decodes exactly `--gen-len` tokens.
"""

import json
from pathlib import Path

from sparrow.tables import format_table

EXTRA_SHAPES = {
    # name: (family, layers, q heads, kv heads, head_dim, hidden, intermediate, vocab, tied, rope theta, max positions)
    "smollm2-135m": ("llama", 30, 9, 3, 64, 576, 1536, 49152, True, 100000.0, 8192),
    "tiny": ("qwen3", 4, 4, 2, 32, 64, 128, 2048, True, 1000000.0, 4096),
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: rollout throughput, decode kernel bandwidth")
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
    r.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    r.add_argument("--repeats", type=int, default=1,
                   help="measure dense and sparse alternately this many times and keep each mode's fastest run")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--json", action="store_true", help="print the results as one JSON object")
    r.set_defaults(handler=run_rollout)
    register_kernels(actions)


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


def model_spec_for_shape(name: str):
    """A `ModelSpec` for a shape name: sparrow.cost's built-in shapes or EXTRA_SHAPES."""
    from sparrow.cost import BUILTIN_MODELS
    from sparrow.rollout_workers.native.model_spec import ModelSpec

    key = name.lower()
    if key in EXTRA_SHAPES:
        family, layers, q, kv, d, hidden, inter, vocab, tied, theta, max_pos = EXTRA_SHAPES[key]
    elif key in BUILTIN_MODELS:
        s = BUILTIN_MODELS[key]
        family = "qwen3" if s.qk_norm else "llama"
        layers, q, kv, d, hidden, inter, vocab, tied = (s.layers, s.q_heads, s.kv_heads, s.head_dim, s.hidden,
                                                        s.intermediate, s.vocab, s.tied_embeddings)
        theta, max_pos = 1000000.0, 40960
    else:
        raise ValueError(
            f"--model {name!r}: not a directory and not a shape; shapes: {', '.join([*EXTRA_SHAPES, *BUILTIN_MODELS])}"
        )
    return ModelSpec(
        family=family, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=q,
        num_kv_heads=kv, head_dim=d, rms_norm_eps=1e-6, max_position_embeddings=max_pos, tie_word_embeddings=tied,
        qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=family == "qwen3",
        rope={"rope_type": "default", "rope_theta": theta},
    )


def build_model(name: str, device, dtype, max_len: int, seed: int):
    from sparrow.rollout_workers.native import DecoderModel, load_model

    if Path(name).is_dir():
        return load_model(name, device, dtype)
    spec = model_spec_for_shape(name)
    if max_len > spec.max_position_embeddings:
        raise ValueError(f"--prompt-len + --gen-len = {max_len} exceeds {name}'s {spec.max_position_embeddings} positions")
    return DecoderModel(spec, spec.max_position_embeddings, device=device, dtype=dtype).init_random(seed)


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
    from sparrow.rollout_workers.native.engine import resolve_device, resolve_dtype
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
    model = build_model(args.model, device, dtype, total, args.seed)
    if args.budget is not None:
        if args.budget < 3:
            raise ValueError(f"--budget={args.budget}: must be >= 3 (sink 1 + recent 2)")
        schedule = SparsitySchedule(name=f"budget-{args.budget}", topk_blocks=(args.budget - 3,), edges=())
    else:
        schedule = load_schedule(args.schedule)
    blocks_per_seq = -(-(total + 1) // 16)
    config = NativeEngineConfig(
        device=str(device), dtype=args.dtype, attention_backend=args.attention_backend, max_num_seqs=args.batch,
        num_kv_blocks=args.batch * blocks_per_seq + 16, max_model_len=min(total + 16, model.rope.cos.shape[0]),
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
            "backend": engine.backend.name, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
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
