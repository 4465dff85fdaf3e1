"""`sparrow bench trainer`: trainer throughput and weight-publication time on synthetic trajectories (no Ray needed).

Spawns `ranks` trainer processes (and one receiving process when publishing), runs warm-up plus
timed `train_step` and `recompute` calls, and broadcasts the weights over a collective weight
group to the receiver. CPU: gloo, float32. CUDA: NCCL, bfloat16; the receiver uses the last GPU.
Under a fixed sparsity budget the step's parts are timed too (exact α, the policy update, the
DistillSparse pass), and `profile` prints each part's heaviest operators from torch's profiler.
"""

import json
import sys
import time

import torch
import torch.multiprocessing as mp

from sparrow.processes import free_port, gather
from sparrow.schedule import SparsitySchedule
from sparrow.tables import format_table
from sparrow.trainer.batch import Trajectory, TrajectoryBatch


def synthetic_batch(num: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> TrajectoryBatch:
    g = torch.Generator().manual_seed(seed)
    trajs = [
        Trajectory(
            prompt_ids=torch.randint(3, vocab, (prompt_len,), generator=g),
            response_ids=torch.randint(3, vocab, (response_len,), generator=g),
            rollout_logprobs=-torch.rand(response_len, generator=g) * 8,
            reward=float(i % 2),
            group_id=str(i // 4),
            top_ids=torch.randint(3, vocab, (response_len, 20), generator=g),
            top_logprobs=-torch.rand(response_len, 20, generator=g).sort(-1).values * 8,
        )
        for i in range(num)
    ]
    return TrajectoryBatch(trajs).with_grpo_advantages()


def _profile(call, top: int, device: torch.device) -> str:
    """One call under torch's profiler: its `top` operators by self time on the device (the CPU without a GPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=key, row_limit=top)


def _trainer(rank, world, config, master_port, weight_port, args, queue):
    from sparrow.trainer.rank import TrainerRank

    trainer = TrainerRank(config, rank, world)
    trainer.setup("127.0.0.1", master_port)
    if args["schedule"]:
        trainer.set_schedule(args["schedule"])
    batch = synthetic_batch(args["batch"], args["prompt_len"], args["response_len"], trainer.vocab_size)
    shard = batch.shard(world)[rank][1]
    began = time.perf_counter()

    def progress(what: str) -> None:  # rank 0 says what it starts, so a long benchmark is not silent
        if rank == 0:
            print(f"bench trainer [{time.perf_counter() - began:6.1f} s] {what}", file=sys.stderr, flush=True)

    progress("warm-up train_step")
    trainer.train_step(shard)
    row = {}
    for name, call in (("train_step", trainer.train_step), ("recompute", trainer.recompute)):
        start = time.perf_counter()
        for i in range(args["steps"]):
            progress(f"{name} {i + 1}/{args['steps']}")
            result = call(shard)
        row[name] = (time.perf_counter() - start) / args["steps"]
        row[f"{name}_metrics"] = result.metrics
    if trainer.device.type == "cuda":
        row["max_memory_gib"] = torch.cuda.max_memory_allocated(trainer.device) / 2**30
    if args["profile"]:
        parts = {"train_step": lambda: trainer.train_step(shard)}
        if trainer.config.exact_alpha:
            parts["exact α"] = lambda: trainer.measure_sparse_alpha(shard)
        if trainer.config.distill_sparse.enabled:
            dense = trainer.recompute(shard).logprobs
            parts["DistillSparse pass"] = lambda: trainer.distill_step(shard, dense)
        row["profile"] = {}
        for name, call in parts.items():
            progress(f"profiling {name}")
            row["profile"][name] = _profile(call, args["profile"], trainer.device)
    if args["publish"]:
        trainer.init_weight_group("127.0.0.1", weight_port, 2)
        reports = [trainer.publish_weights(v, "collective") for v in range(1, args["publishes"] + 1)]
        if rank == 0:
            row["publish"] = [r.metrics() for r in reports]
            trainer.weight_group.close()
    if rank == 0:
        queue.put(("trainer", row))


def _receiver(weight_port, args, device, queue):
    from sparrow.weight_sync import CollectiveGroup, CollectiveSource, receive_state_dict

    group = CollectiveGroup("127.0.0.1", weight_port, 1, 2, backend="nccl" if device.startswith("cuda") else "gloo", device=device)
    times = []
    for _ in range(args["publishes"]):
        start = time.perf_counter()
        state, version = receive_state_dict(CollectiveSource(group), device)
        times.append(time.perf_counter() - start)
    group.close()
    queue.put(("receiver", {"seconds": times, "tensors": len(state), "version": version}))


def run(config: dict, ranks: int, batch: int, prompt_len: int, response_len: int, steps: int, publish: bool,
        publishes: int = 2, budget_blocks: int = 0, profile: int = 0) -> dict:
    """Returns rank 0's timings and metrics (and the receiver's, when publishing). `budget_blocks` > 0 sets a fixed
    sparsity schedule of that many blocks per query (what exact α and DistillSparse run under); `profile` > 0 adds
    rank 0's top operators of each part of a step."""
    schedule = SparsitySchedule.fixed_budget(budget_blocks, "--budget-blocks").to_dict() if budget_blocks else None
    args = {"batch": batch, "prompt_len": prompt_len, "response_len": response_len, "steps": steps,
            "publish": publish, "publishes": publishes, "schedule": schedule, "profile": profile}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    master, weights = free_port(), free_port()
    procs = [ctx.Process(target=_trainer, args=(r, ranks, config, master, weights, args, queue)) for r in range(ranks)]
    if publish:
        device = f"cuda:{torch.cuda.device_count() - 1}" if config.get("device") == "cuda" else "cpu"
        procs.append(ctx.Process(target=_receiver, args=(weights, args, device, queue)))
    return gather(procs, queue, 2 if publish else 1, "sparrow bench trainer")


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
