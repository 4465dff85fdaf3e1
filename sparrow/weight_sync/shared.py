"""Weights handed over in place to a process on the same GPU (CUDA IPC) or the same host (shared memory).

When a trainer rank and a rollout engine share a device (colocated placement), a version need not leave
it: the sender keeps one set of flat bucket buffers for its manifest's layout and packs every version into
them; the receiver maps that set once — CUDA IPC handles on a GPU, named files under /dev/shm on the CPU —
and reads each later version from the same memory. A version then costs the sender's pack and the
receiver's copy into its weights: no host round trip, no serialisation, and the handles travel only with
the first version of a layout (opening them is the slow part: one `cudaIpcOpenMemHandle` per buffer).

The sender rewrites the buffers at its next publication, so a receiver must have loaded a version before
the next one is sent; the job settles every load before it trains again (coordinator/job/publication.py).
"""

import itertools
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .buckets import DTYPES, Bucket, Manifest

_layouts = itertools.count()


@dataclass(frozen=True)
class SharedBuffer:
    """How to map one bucket buffer: a file path (CPU) or CUDA IPC rebuild arguments and the GPU's UUID."""

    dtype: str
    numel: int
    path: str | None = None
    ipc: tuple | None = None
    device_uuid: str | None = None


@dataclass
class SharedHandle:
    """A version in shared buffers: pass it to the receiving process (it pickles small: no tensor data)."""

    manifest_json: str
    layout_id: str
    """The buffer set; a receiver maps a set once and reuses the mapping for every version written into it."""
    buffers: list[SharedBuffer]

    @property
    def version(self) -> int:
        return Manifest.from_json(self.manifest_json).version


def _device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def current_gpu() -> str | None:
    """The UUID of the GPU this process computes on (None without one): two processes with the same one can hand
    weights over in place, and cannot both be ranks of one NCCL group."""
    if not torch.cuda.is_available():
        return None
    return _device_uuid(torch.device("cuda", torch.cuda.current_device()))


def shm_dir() -> Path:
    """Where CPU buffers live: /dev/shm (RAM) where it exists, else the temp directory."""
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


class SharedSender:
    """The sending end (begin / buffer / send / finish, as every sender of `sparrow.weight_sync`)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self._layout: tuple | None = None
        self._buffers: list[torch.Tensor] = []
        self._described: list[SharedBuffer] = []
        self._paths: list[Path] = []
        self.layout_id = ""

    def begin(self, manifest: Manifest) -> None:
        layout = tuple((b.dtype, b.numel) for b in manifest.buckets)
        if layout != self._layout:
            self.close()
            self._allocate(manifest.buckets)
            self._layout = layout
        self.manifest = manifest

    def _allocate(self, buckets: list[Bucket]) -> None:
        self.layout_id = f"{os.getpid()}-{next(_layouts)}"
        if self.device.type != "cuda":
            remove_orphans()
        for index, bucket in enumerate(buckets):
            dtype = DTYPES[bucket.dtype]
            if self.device.type == "cuda":
                from torch.multiprocessing.reductions import reduce_tensor

                buffer = torch.empty(bucket.numel, dtype=dtype, device=self.device)
                _, args = reduce_tensor(buffer)
                described = SharedBuffer(bucket.dtype, bucket.numel, ipc=args, device_uuid=_device_uuid(self.device))
            else:
                path = shm_dir() / f"sparrow-weights-{self.layout_id}-{index}"
                buffer = torch.from_file(str(path), shared=True, size=bucket.numel, dtype=dtype)
                self._paths.append(path)
                described = SharedBuffer(bucket.dtype, bucket.numel, path=str(path))
            self._buffers.append(buffer)
            self._described.append(described)

    def buffer(self, index: int) -> torch.Tensor:
        """Bucket `index`'s buffer, for packing the version straight into it."""
        return self._buffers[index]

    def send(self, index: int, flat: torch.Tensor) -> None:
        if flat.data_ptr() != self._buffers[index].data_ptr():
            self._buffers[index].copy_(flat)

    def finish(self) -> SharedHandle:
        """Returns once the version is in the buffers (the receiver may read as soon as it has the handle)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return SharedHandle(self.manifest.to_json(), self.layout_id, list(self._described))

    def close(self) -> None:
        """Release the buffers: a receiver's mapping of a CPU file stays valid; CUDA memory a receiver still maps
        is freed when it lets go (`torch.cuda.ipc_collect` reclaims the sender's side)."""
        for path in self._paths:
            path.unlink(missing_ok=True)
        self._buffers, self._described, self._paths, self._layout = [], [], [], None
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_orphans() -> list[Path]:
    """Delete the CPU buffers of senders that died without closing them (a killed trainer rank): the files would
    hold host memory until the machine restarts."""
    removed = []
    for path in shm_dir().glob("sparrow-weights-*"):
        pid = path.name.split("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _local_cuda_index(uuid: str) -> int:
    """This process's index of the GPU with `uuid` (its CUDA_VISIBLE_DEVICES may number it differently)."""
    for index in range(torch.cuda.device_count()):
        if _device_uuid(torch.device("cuda", index)) == uuid:
            return index
    raise RuntimeError(f"GPU {uuid} of the sender is not visible to this process; shared weights need both on one GPU")


def _map(buffer: SharedBuffer) -> torch.Tensor:
    if buffer.path is not None:
        if not Path(buffer.path).is_file():
            raise FileNotFoundError(f"shared weight buffer {buffer.path} is gone (its sender closed it)")
        return torch.from_file(buffer.path, shared=True, size=buffer.numel, dtype=DTYPES[buffer.dtype])
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(buffer.ipc)
    args[6] = _local_cuda_index(buffer.device_uuid)  # the storage's device, in this process's numbering
    return rebuild_cuda_tensor(*args)


class SharedMappings:
    """A receiver's mapped buffer sets, by layout; a new layout from a sender replaces that sender's old one."""

    def __init__(self):
        self._sets: dict[str, list[torch.Tensor]] = {}

    def tensors(self, handle: SharedHandle) -> list[torch.Tensor]:
        if handle.layout_id not in self._sets:
            sender = handle.layout_id.split("-")[0]
            for stale in [k for k in self._sets if k.split("-")[0] == sender]:
                del self._sets[stale]
            self._sets[handle.layout_id] = [_map(b) for b in handle.buffers]
        return self._sets[handle.layout_id]


class SharedStateDict(dict):
    """A version's tensors as views of the shared buffers they were read from, with the `handle` that maps them: a
    receiver that loads weights through another process on the same GPU or host (vLLM's worker) passes the handle
    on instead of copying the tensors into buffers of its own. Valid until the sender's next publication."""

    def __init__(self, tensors: dict[str, torch.Tensor], handle: SharedHandle):
        super().__init__(tensors)
        self.handle = handle


class SharedSource:
    """The receiving end: every bucket as a view of the shared buffer (no copy; `staging` None)."""

    staging = None

    def __init__(self, handle: SharedHandle, mappings: SharedMappings):
        self.handle, self.mappings = handle, mappings

    def manifest(self) -> Manifest:
        manifest = Manifest.from_json(self.handle.manifest_json)
        if len(manifest.buckets) != len(self.handle.buffers):
            raise ValueError(f"shared handle has {len(self.handle.buffers)} buffers; its manifest lists {len(manifest.buckets)}")
        return manifest

    def bucket(self, index: int, bucket: Bucket) -> torch.Tensor:
        flat = self.mappings.tensors(self.handle)[index]
        if flat.numel() != bucket.numel or flat.dtype != DTYPES[bucket.dtype]:
            raise ValueError(f"shared buffer {index} holds {flat.numel()} {flat.dtype}; the manifest says "
                             f"{bucket.numel} {bucket.dtype}")
        return flat

    def finish(self) -> None:
        return None
