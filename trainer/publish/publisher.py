"""A trainer rank's side of weight publication: the broadcast group (rank 0 only), the finiteness check every
rank takes part in, and sending a version bucket by bucket (every rank gathers, rank 0 sends; on the "shared"
channel every rank packs into its own shared buffers, for the rollout worker on its GPU)."""

import time

import torch

from sparrow.finite import first_nonfinite
from sparrow.weight_sync import CollectiveGroup, CollectiveSender, Manifest, ObjectStoreSender, SharedSender, plan_buckets
from sparrow.weight_sync.send import PublishReport, send_buckets

from ..collectives import all_reduce_scalar
from ..config import PublishConfig
from ..export import WeightExporter

CHANNELS = ("collective", "object_store", "shared")


class WeightPublisher:
    def __init__(self, rank: int, exporter: WeightExporter, config: PublishConfig, merge_lora: bool, device: torch.device):
        self.rank, self.exporter, self.config, self.merge_lora, self.device = rank, exporter, config, merge_lora, device
        self.group: CollectiveGroup | None = None
        self.shared: SharedSender | None = None
        """This rank's buffers on the "shared" channel, created at its first use and rewritten every version."""

    def join_group(self, host: str, port: int, world_size: int, backend: str | None = None) -> None:
        """Rank 0 joins a broadcast group as its rank 0 (rollout workers are ranks 1..world_size-1), leaving the one
        it was in; blocks until every member has joined. Other ranks do nothing."""
        if self.rank != 0:
            return
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        if self.group is not None:  # re-formed (a worker joined, left or was replaced): leave the old one
            self.group.close()
            self.group = None
        self.group = CollectiveGroup(
            host, port, 0, world_size, backend=backend, device=self.device, timeout_s=self.config.timeout_s
        )

    def weights_finite(self) -> bool:
        """True when no rank holds a NaN/Inf weight (each checks its own ZeRO-3 partition); collective."""
        local = {n: p.ds_tensor if hasattr(p, "ds_tensor") else p.data for n, p in self.exporter.params.items()}
        return all_reduce_scalar(float(first_nonfinite(local) is not None), "max", self.device) == 0.0

    def publish(self, version: int, channel: str) -> PublishReport | None:
        """Send the full policy (LoRA merged when asked) as `version`, or refuse non-finite weights; collective.
        Rank 0's report, None elsewhere; on the "shared" channel every rank's (each carries its own handle)."""
        if channel not in CHANNELS:
            raise ValueError(f"channel={channel!r}: use one of {', '.join(CHANNELS)}")
        answers = self.rank == 0 or channel == "shared"
        start = time.perf_counter()
        if not self.weights_finite():
            refused = f"version {version} holds NaN/Inf weights; not sent (the rollout pool keeps its version)"
            return PublishReport(version, 0, 0, 0, 0.0, refused=refused) if answers else None
        manifest = Manifest(version, plan_buckets(self.exporter.specs(), int(self.config.bucket_mb * 2**20)))
        tensors = lambda bucket: self.exporter.tensors([e.name for e in bucket.entries], self.merge_lora)  # noqa: E731
        report = send_buckets(manifest, tensors, self._sender(channel))
        report.seconds = time.perf_counter() - start  # the finiteness check included
        return report if answers else None

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
            self.shared = None

    def _sender(self, channel: str):
        """This rank's sender for `channel`: rank 0's, or every rank's own shared buffers; None on the other ranks,
        which only join the gathers."""
        if channel == "shared":
            self.shared = self.shared or SharedSender(self.device)
            return self.shared
        if self.rank != 0:
            return None
        if channel == "object_store":
            return ObjectStoreSender()
        if self.group is None:
            raise RuntimeError("publish_weights(channel='collective') before init_weight_group()")
        return CollectiveSender(self.group)
