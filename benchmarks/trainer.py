"""Trainer throughput and weight-publication time on synthetic trajectories (no Ray needed).

Spawns `ranks` trainer processes (and one receiving process when publishing), runs warm-up plus
timed `train_step` and `recompute` calls, and broadcasts the weights over a collective weight
group to the receiver. CPU: gloo, float32. CUDA: NCCL, bfloat16; the receiver uses the last GPU.
Under a fixed sparsity budget the step's parts are timed too (exact α, the policy update, the
DistillSparse pass), and `profile` prints each part's heaviest operators from torch's profiler.
"""

import sys
import time

import torch
import torch.multiprocessing as mp

from sparrow.processes import free_port, gather
from sparrow.schedule import SparsitySchedule

from .batch import Trajectory, TrajectoryBatch


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
    from .rank import TrainerRank

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
