"""Trainer throughput and weight-publication time on synthetic trajectories (no Ray needed).

Spawns `ranks` trainer processes (and one receiving process when publishing), runs warm-up plus
timed `train_step` and `recompute` calls, and broadcasts the weights over a collective weight
group to the receiver. CPU: gloo, float32. CUDA: NCCL, bfloat16; the receiver uses the last GPU.
"""

import time

import torch
import torch.multiprocessing as mp

from sparrow.processes import free_port, gather

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


def _trainer(rank, world, config, master_port, weight_port, args, queue):
    from .rank import TrainerRank

    trainer = TrainerRank(config, rank, world)
    trainer.setup("127.0.0.1", master_port)
    batch = synthetic_batch(args["batch"], args["prompt_len"], args["response_len"], trainer.vocab_size)
    shard = batch.shard(world)[rank][1]
    trainer.train_step(shard)  # warm-up
    row = {}
    for name, call in (("train_step", trainer.train_step), ("recompute", trainer.recompute)):
        start = time.perf_counter()
        for _ in range(args["steps"]):
            result = call(shard)
        row[name] = (time.perf_counter() - start) / args["steps"]
        row[f"{name}_metrics"] = result.metrics
    if trainer.device.type == "cuda":
        row["max_memory_gib"] = torch.cuda.max_memory_allocated(trainer.device) / 2**30
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
        publishes: int = 2) -> dict:
    """Returns rank 0's timings and metrics (and the receiver's, when publishing)."""
    args = {"batch": batch, "prompt_len": prompt_len, "response_len": response_len, "steps": steps,
            "publish": publish, "publishes": publishes}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    master, weights = free_port(), free_port()
    procs = [ctx.Process(target=_trainer, args=(r, ranks, config, master, weights, args, queue)) for r in range(ranks)]
    if publish:
        device = f"cuda:{torch.cuda.device_count() - 1}" if config.get("device") == "cuda" else "cpu"
        procs.append(ctx.Process(target=_receiver, args=(weights, args, device, queue)))
    return gather(procs, queue, 2 if publish else 1, "sparrow bench trainer")
