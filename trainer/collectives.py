"""Small reductions over the trainer's process group (the one DeepSpeed initialised)."""

import torch
import torch.distributed as dist


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_dict(values: dict[str, torch.Tensor | float], op: str, device: torch.device) -> dict[str, float]:
    """Sum or max of each entry over ranks; every rank must pass the same keys."""
    if not values:
        return {}
    keys = sorted(values)
    buf = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
    if _active():
        dist.all_reduce(buf, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return dict(zip(keys, buf.tolist()))


def all_reduce_scalar(value: float, op: str, device: torch.device) -> float:
    return all_reduce_dict({"v": value}, op, device)["v"]


def all_gather_objects(obj) -> list:
    if not _active():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_grads(params: list[torch.nn.Parameter]) -> None:
    """Sum `.grad` over ranks (gradients of a loss already normalised by the global token count)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    if not _active() or not params:
        return
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
        offset += p.numel()
