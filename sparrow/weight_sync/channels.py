"""Ways to move buckets from trainer rank 0 to rollout workers.

- `CollectiveGroup`: a standalone torch process group (its own TCPStore, not the trainer's world)
  with trainer rank 0 as rank 0 and the rollout workers as ranks 1..N; buckets are broadcast, over
  NCCL on GPU or gloo on CPU.
- `ObjectStoreSender` / `HandleSource`: buckets go into Ray's object store and a `WeightHandle`
  (manifest + object refs) is passed to the workers, which fetch them.

Senders have a `device` (where buckets are packed) and implement begin(manifest) / send(bucket index,
flat tensor) / finish(); sources (the receiving side) implement manifest() / bucket(index, bucket) /
finish(). finish() returns once the data has landed, so the publication time covers the whole transfer.
"""

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .buckets import DTYPES, Bucket, Manifest

_NCCL = getattr(dist, "ProcessGroupNCCL", ())
"""The NCCL group class (absent from CPU builds of torch)."""


class CollectiveGroup:
    """One member of a standalone broadcast group; rank 0 is the sender and hosts the store."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, backend: str = "gloo",
                 device: str | torch.device = "cpu", timeout_s: float = 600.0, name: str = "sparrow-weights"):
        if world_size < 2:
            raise ValueError(f"world_size={world_size}: a weight group needs the sender and at least one receiver")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}: must be in [0, {world_size})")
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore(name, self.store)
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        elif backend == "nccl":
            self.group = dist.ProcessGroupNCCL(prefixed, rank, world_size)
        else:
            raise ValueError(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (GPU)")

    def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        self.group.broadcast(tensor, 0).wait()
        return tensor

    def synchronize(self) -> None:
        """Wait until the broadcasts have landed (NCCL's wait() only orders the CUDA stream)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Leave the group once its broadcasts have landed, without waiting for the other members: they may be
        gone (a lost worker) or leaving at the same moment (the group re-formed after a resize). NCCL's
        graceful shutdown finalises the communicator with its peers, so a member leaving while the others
        wait in the next group's rendezvous can block both; `abort` releases this member's side alone."""
        self.synchronize()
        if isinstance(self.group, _NCCL):
            self.group.abort()
        elif hasattr(self.group, "shutdown"):
            self.group.shutdown()

    def broadcast_bytes(self, payload: bytes | None) -> bytes:
        size = torch.tensor([len(payload) if self.rank == 0 else 0], dtype=torch.long, device=self.device)
        self.broadcast(size)
        buf = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
            if self.rank == 0
            else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        )
        return bytes(self.broadcast(buf).cpu().numpy().tobytes())


class CollectiveSender:
    def __init__(self, group: CollectiveGroup):
        if group.rank != 0:
            raise ValueError(f"only rank 0 of a weight group sends; this member is rank {group.rank}")
        self.group = group
        self.device = group.device
        """Where buckets are packed: the group's device, so NCCL sends them straight from GPU memory."""

    def begin(self, manifest: Manifest) -> None:
        self.group.broadcast_bytes(manifest.to_json().encode())

    def send(self, index: int, flat: torch.Tensor) -> None:
        self.group.broadcast(flat.to(self.device))

    def finish(self) -> None:
        self.group.synchronize()


class CollectiveSource:
    def __init__(self, group: CollectiveGroup):
        if group.rank == 0:
            raise ValueError("rank 0 of a weight group is the sender; receivers have ranks 1..N")
        self.group = group

    def manifest(self) -> Manifest:
        return Manifest.from_json(self.group.broadcast_bytes(None).decode())

    def bucket(self, index: int, bucket: Bucket) -> torch.Tensor:
        return self.group.broadcast(torch.empty(bucket.numel, dtype=DTYPES[bucket.dtype], device=self.group.device))

    def finish(self) -> None:
        self.group.synchronize()


@dataclass
class WeightHandle:
    """A published version in Ray's object store; pass it to rollout workers."""

    manifest_json: str
    refs: list


class ObjectStoreSender:
    device = torch.device("cpu")
    """Buckets are packed in host memory, where Ray's object store keeps them."""

    def begin(self, manifest: Manifest) -> None:
        self.manifest, self.refs = manifest, []

    def send(self, index: int, flat: torch.Tensor) -> None:
        import ray

        self.refs.append(ray.put(flat.cpu()))

    def finish(self) -> WeightHandle:
        return WeightHandle(self.manifest.to_json(), self.refs)


class HandleSource:
    def __init__(self, handle: WeightHandle):
        self.handle = handle

    def manifest(self) -> Manifest:
        manifest = Manifest.from_json(self.handle.manifest_json)
        if len(manifest.buckets) != len(self.handle.refs):
            raise ValueError(f"weight handle has {len(self.handle.refs)} buckets; its manifest lists {len(manifest.buckets)}")
        return manifest

    def bucket(self, index: int, bucket: Bucket) -> torch.Tensor:
        import ray

        return ray.get(self.handle.refs[index])

    def finish(self) -> None:
        return None
