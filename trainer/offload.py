"""A rank's training states off the GPU and back: the trainer's half of the colocated placement's turns.

While the rollout engine on the same GPU generates, the DeepSpeed engine's optimizer states, fp32 master
weights, gradients and bf16 weights wait in pinned host memory (DeepSpeed's `offload_states`, made for this
time-sharing); they come back before the update (`reload_states`), which runs on the GPU as ever. The
DistillSparse adapter and the reference model stay where they are. On a CPU rank the states already live in
host memory: both are no-ops.
"""

import time

import torch

from .engine import initialize_adam_states
from .policy import Policy


def _moved(policy: Policy, move) -> dict[str, float]:
    if policy.device.type != "cuda":
        return {"seconds": 0.0, "bytes": 0}
    start = time.perf_counter()
    before = torch.cuda.memory_allocated(policy.device)
    move()
    torch.cuda.synchronize(policy.device)
    torch.cuda.empty_cache()
    return {"seconds": time.perf_counter() - start, "bytes": abs(before - torch.cuda.memory_allocated(policy.device))}


def offload_states(policy: Policy) -> dict[str, float]:
    """Everything DeepSpeed keeps for training to host memory; the seconds it took and the GPU bytes freed. Adam's
    moments are made first if no update has made them yet, so the job's start-up offload allocates their pinned
    buffers, not the first step's (on a CPU rank too, where nothing moves: one code path)."""
    initialize_adam_states(getattr(policy.engine.optimizer, "optimizer", policy.engine.optimizer))
    return _moved(policy, policy.engine.offload_states)


def reload_states(policy: Policy) -> dict[str, float]:
    """What `offload_states` moved, back on the GPU; the seconds and bytes."""
    return _moved(policy, policy.engine.reload_states)
