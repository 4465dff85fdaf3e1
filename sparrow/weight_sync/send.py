"""Sending a versioned state dict through a sender (any channel of `sparrow.weight_sync`): the trainer publishes
its policy this way, and an engine hands a state dict to a process of its own (vLLM's engine core)."""

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from .buckets import Bucket, Manifest, pack, plan_buckets


@dataclass
class PublishReport:
    version: int
    nbytes: int
    num_buckets: int
    num_tensors: int
    seconds: float
    handle: Any = None
    """The `WeightHandle` when publishing through Ray's object store."""
    refused: str | None = None
    """Why nothing was sent (the weights failed the finiteness check), or None."""

    def metrics(self) -> dict[str, float]:
        return {
            "publish/seconds": self.seconds,
            "publish/bytes": float(self.nbytes),
            "publish/buckets": float(self.num_buckets),
            "publish/gbytes_per_s": self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0,
        }


def send_buckets(
    manifest: Manifest,
    bucket_tensors: Callable[[Bucket], AbstractContextManager[Mapping[str, torch.Tensor]]],
    sender,
) -> PublishReport:
    """Send every bucket of `manifest`; `bucket_tensors(bucket)` yields that bucket's tensors, packed on the
    sender's device (a collective group's GPU: no round trip through host memory).

    `sender=None` still walks the buckets (other trainer ranks must join each ZeRO-3 gather).
    """
    start = time.perf_counter()
    if sender is not None:
        sender.begin(manifest)
    for index, bucket in enumerate(manifest.buckets):
        with bucket_tensors(bucket) as tensors:
            if sender is not None:  # a sender with buffers of its own (shared) has the bucket packed straight into them
                out = sender.buffer(index) if hasattr(sender, "buffer") else None
                sender.send(index, pack(bucket, tensors, sender.device, out))
    handle = sender.finish() if sender is not None else None
    return PublishReport(
        version=manifest.version,
        nbytes=manifest.nbytes,
        num_buckets=len(manifest.buckets),
        num_tensors=len(manifest.names),
        seconds=time.perf_counter() - start,
        handle=handle,
    )


def publish_state_dict(state_dict: Mapping[str, torch.Tensor], version: int, sender, bucket_bytes: int) -> PublishReport:
    """Publish an arbitrary state dict (e.g. a checkpoint) as `version`."""
    specs = [(name, tuple(t.shape), t.dtype) for name, t in state_dict.items()]
    manifest = Manifest(version, plan_buckets(specs, bucket_bytes))
    return send_buckets(manifest, lambda b: nullcontext({e.name: state_dict[e.name] for e in b.entries}), sender)
