"""`sparrow bench rollout ...`: dense vs block-sparse rollout throughput of the native engine, side by
side in one process on the same weights. A benchmark, not a test: it prints what it measured.

`--model` is an HF directory (real weights) or a shape name (`sparrow cost` shapes such as
qwen3-1.7b, plus smollm2-135m and tiny) built with random weights. Prompts are random token ids and
samples ignore EOS, so every sample decodes exactly `--gen-len` tokens.
"""

import json

from sparrow.kernels.bench_cli import register as register_kernels
from sparrow.rollout_workers.native.bench.cli import register_decode_step, register_rollout_paper
from sparrow.tables import format_table
from sparrow.trainer.cli import register as register_trainer


def configure(p) -> None:
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
