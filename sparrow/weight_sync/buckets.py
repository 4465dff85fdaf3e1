"""Bucketed weight transfer: a manifest of (name, shape, dtype, offset) and flat same-dtype buckets.

Buckets are planned from the tensors' specs alone, so every trainer rank computes the same plan and
can gather (ZeRO-3) bucket by bucket in lockstep while rank 0 sends; a tensor larger than the bucket
size travels alone. The manifest is JSON, so no pickle crosses process boundaries.
"""

import json
import math
from dataclasses import asdict, dataclass, field

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    for name, dt in DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"dtype {dtype}: weights must be float32, bfloat16 or float16 to be published")


@dataclass(frozen=True)
class Entry:
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Bucket:
    dtype: str
    entries: list[Entry] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


@dataclass
class Manifest:
    version: int
    buckets: list[Bucket]

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def names(self) -> list[str]:
        return [e.name for b in self.buckets for e in b.entries]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Manifest":
        data = json.loads(text)
        buckets = [
            Bucket(b["dtype"], [Entry(e["name"], tuple(e["shape"]), e["offset"]) for e in b["entries"]]) for b in data["buckets"]
        ]
        for b in buckets:
            if b.dtype not in DTYPES:
                raise ValueError(f"manifest bucket dtype {b.dtype!r}: expected one of {sorted(DTYPES)}")
        return cls(version=int(data["version"]), buckets=buckets)


def plan_buckets(specs: list[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> list[Bucket]:
    """Consecutive tensors share a bucket while they have one dtype and fit in `bucket_bytes`."""
    buckets: list[Bucket] = []
    seen: set[str] = set()
    for name, shape, dtype in specs:
        if name in seen:
            raise ValueError(f"tensor {name!r} is listed twice")
        seen.add(name)
        dt = dtype_name(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        current = buckets[-1] if buckets else None
        if current is None or current.dtype != dt or (current.entries and current.nbytes + nbytes > bucket_bytes):
            current = Bucket(dt)
            buckets.append(current)
        current.entries.append(Entry(name, tuple(int(s) for s in shape), current.numel))
    return buckets


def pack(bucket: Bucket, tensors: dict[str, torch.Tensor], device: torch.device | str = "cpu",
         out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's tensors in one flat tensor: `out` when given (a sender's own buffer), else a new one on `device`."""
    flat = torch.empty(bucket.numel, dtype=DTYPES[bucket.dtype], device=device) if out is None else out
    for e in bucket.entries:
        t = tensors[e.name]
        if tuple(t.shape) != e.shape:
            raise ValueError(f"{e.name}: shape {tuple(t.shape)} differs from the planned {e.shape}")
        flat[e.offset : e.offset + e.numel].copy_(t.reshape(-1))
    return flat


def unpack(bucket: Bucket, flat: torch.Tensor) -> dict[str, torch.Tensor]:
    if flat.numel() != bucket.numel or flat.dtype != DTYPES[bucket.dtype]:
        raise ValueError(
            f"bucket holds {flat.numel()} {flat.dtype} values; the manifest says {bucket.numel} {bucket.dtype}"
        )
    return {e.name: flat[e.offset : e.offset + e.numel].view(e.shape) for e in bucket.entries}
