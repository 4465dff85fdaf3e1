"""Publishing a versioned state dict through a sender, and receiving it into a rollout engine."""

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from .buckets import Bucket, Manifest, pack, plan_buckets, unpack


@dataclass
class PublishReport:
    version: int
    nbytes: int
    num_buckets: int
    num_tensors: int
    seconds: float
    handle: Any = None
    """The `WeightHandle` when publishing through Ray's object store."""

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
    device: torch.device | str = "cpu",
) -> PublishReport:
    """Send every bucket of `manifest`; `bucket_tensors(bucket)` yields that bucket's tensors.

    `sender=None` still walks the buckets (other trainer ranks must join each ZeRO-3 gather).
    """
    start = time.perf_counter()
    if sender is not None:
        sender.begin(manifest)
    for index, bucket in enumerate(manifest.buckets):
        with bucket_tensors(bucket) as tensors:
            if sender is not None:
                sender.send(index, pack(bucket, tensors, device))
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


def receive_state_dict(source, device: torch.device | str = "cpu") -> tuple[dict[str, torch.Tensor], int]:
    """All tensors of one published version, on `device`."""
    manifest = source.manifest()
    state: dict[str, torch.Tensor] = {}
    for index, bucket in enumerate(manifest.buckets):
        state.update(unpack(bucket, source.bucket(index, bucket).to(device)))
    source.finish()
    return state, manifest.version


class WeightsRefused(ValueError):
    """A published version the rollout side did not take; the old weights keep serving."""


@dataclass
class ReceiveReport:
    version: int
    nbytes: int
    seconds: float


class WeightReceiver:
    """The rollout side: receive a version and hand it to `engine.load_weights`.

    The engine validates the whole state dict before copying (missing/unexpected keys, shapes,
    dtypes, NaN/inf) and keeps serving its old weights when it refuses; the refusal is re-raised
    here with the version, and versions must increase.
    """

    def __init__(self, engine, device: torch.device | str = "cpu"):
        self.engine, self.device = engine, device

    def receive(self, source) -> ReceiveReport:
        start = time.perf_counter()
        state, version = receive_state_dict(source, self.device)
        current = self.engine.policy_version
        if version <= current:
            raise WeightsRefused(f"weights version {version} is not newer than the version being served ({current}); refused")
        try:
            self.engine.load_weights(state, version)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise WeightsRefused(f"weights version {version} refused, still serving version {current}: {exc}") from exc
        return ReceiveReport(version, sum(t.numel() * t.element_size() for t in state.values()), time.perf_counter() - start)

