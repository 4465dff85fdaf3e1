"""`sparrow bench trainer`: time train steps, dense recompute and weight publication on synthetic data."""

import json

from sparrow.tables import format_table

from .bench import run


def register(actions) -> None:
    """Adds `trainer` to `sparrow bench`'s actions."""
    p = actions.add_parser("trainer", help="trainer throughput and weight-publication time (synthetic trajectories)")
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--ranks", type=int, default=2, help="trainer processes (one GPU each on cuda)")
    p.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--batch", type=int, default=8, help="trajectories per step (split over ranks)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--response-len", type=int, default=192)
    p.add_argument("--steps", type=int, default=2, help="timed calls after one warm-up step")
    p.add_argument("--micro-batch-tokens", type=int, default=4096)
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--no-publish", action="store_true", help="skip the weight broadcast to a receiver process")
    p.add_argument("--bucket-mb", type=float, default=256.0)
    p.add_argument("--distill-sparse", action="store_true", help="DistillSparse on: each step adds the LoRA pass")
    p.add_argument("--exact-alpha", action="store_true", help="trainer.exact_alpha on: each step measures exact α")
    p.add_argument("--budget-blocks", type=int, default=16,
                   help="total blocks per query of the fixed schedule the sparse forwards run under (with "
                        "--distill-sparse or --exact-alpha)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="print rank 0's N heaviest operators (device time on a GPU) for the step and each of its parts")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run_bench)


def run_bench(args) -> int:
    if args.ranks < 1 or args.batch < args.ranks:
        raise ValueError(f"--ranks {args.ranks} --batch {args.batch}: need 1 <= ranks <= batch")
    config = {
        "model": args.model, "zero_stage": args.zero_stage, "device": args.device,
        "micro_batch_tokens": args.micro_batch_tokens, "gradient_checkpointing": not args.no_gradient_checkpointing,
        "publish": {"bucket_mb": args.bucket_mb},
        "distill_sparse": {"enabled": args.distill_sparse}, "exact_alpha": args.exact_alpha,
    }
    sparse = args.distill_sparse or args.exact_alpha
    out = run(config, args.ranks, args.batch, args.prompt_len, args.response_len, args.steps, not args.no_publish,
              budget_blocks=args.budget_blocks if sparse else 0, profile=args.profile)
    if args.json:
        print(json.dumps(out))
        return 0
    t = out["trainer"]
    tokens = args.batch * (args.prompt_len + args.response_len)
    rows = [["train_step", f"{t['train_step']:.3f}", f"{tokens / t['train_step']:.0f}"]]
    rows += [[f"  {name}", f"{seconds:.3f}", f"{tokens / seconds:.0f}"] for name, seconds in _step_parts(t["train_step_metrics"])]
    rows.append(["recompute (dense log-probs, top-20, α)", f"{t['recompute']:.3f}", f"{tokens / t['recompute']:.0f}"])
    for i, p in enumerate(t.get("publish", [])):
        recv = out["receiver"]["seconds"][i]
        rows.append([f"publish v{i + 1} ({p['publish/bytes'] / 2**20:.0f} MiB, {p['publish/buckets']:.0f} buckets)",
                     f"{p['publish/seconds']:.3f}", f"{p['publish/gbytes_per_s']:.2f} GB/s (receiver {recv:.3f} s)"])
    budget = f", {args.budget_blocks} blocks per query" if sparse else ""
    print(f"{args.ranks} rank(s), ZeRO-{args.zero_stage}, {args.device}, {args.batch} × ({args.prompt_len}+{args.response_len}) "
          f"tokens{budget}; rank 0's last step")
    print(format_table(["call", "seconds", "tokens/s"], rows))
    for name, table in t.get("profile", {}).items():
        print(f"\n{name}: rank 0's heaviest operators\n{table}")
    return 0


def _step_parts(metrics: dict) -> list[tuple[str, float]]:
    """A step's parts from its metrics: exact α and the policy update share `train/seconds`; DistillSparse follows."""
    exact = metrics.get("train/alpha_exact_seconds", 0.0)
    parts = [("exact α (dense + sparse forward)", exact)] if exact else []
    parts.append(("policy update", metrics["train/seconds"] - exact))
    if "distill/seconds" in metrics:
        parts.append(("DistillSparse pass (sparse forward + LoRA backward)", metrics["distill/seconds"]))
    return parts
