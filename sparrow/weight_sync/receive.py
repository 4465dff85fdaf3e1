"""The receiving side: one published version into a rollout engine (any `RolloutEngine`)."""

import time
from dataclasses import dataclass

import torch

from .buckets import unpack
from .shared import SharedSource, SharedStateDict


def receive_state_dict(source, device: torch.device | str | None = "cpu") -> tuple[dict[str, torch.Tensor], int]:
    """All tensors of one published version, on `device` (None: where the source delivers them; read in place from
    shared buffers, they come as a `SharedStateDict`)."""
    manifest = source.manifest()
    state: dict[str, torch.Tensor] = {}
    for index, bucket in enumerate(manifest.buckets):
        flat = source.bucket(index, bucket)
        state.update(unpack(bucket, flat if device is None else flat.to(device)))
    source.finish()
    if device is None and isinstance(source, SharedSource):
        state = SharedStateDict(state, source.handle)
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
    here with the version, and versions must increase unless `allow_older` (after a trainer rollback to a
    checkpoint the rollout side goes back to that checkpoint's version).
    """

    def __init__(self, engine):
        self.engine = engine

    def receive(self, source, allow_older: bool = False) -> ReceiveReport:
        """Buckets are staged in host memory, so a rollout GPU holds one bucket at a time beside its model and
        KV cache (the whole new state dict on the GPU would need the model's size again in free memory); a
        source whose buckets already sit in memory this process maps (`staging = None`: shared buffers) is read
        in place."""
        start = time.perf_counter()
        state, version = receive_state_dict(source, getattr(source, "staging", "cpu"))
        current = self.engine.policy_version
        if version <= current and not allow_older:
            raise WeightsRefused(f"weights version {version} is not newer than the version being served ({current}); refused")
        try:
            self.engine.load_weights(state, version)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise WeightsRefused(f"weights version {version} refused, still serving version {current}: {exc}") from exc
        return ReceiveReport(version, sum(t.numel() * t.element_size() for t in state.values()), time.perf_counter() - start)

