"""GPU profiles: peak dense BF16 FLOP/s and HBM bandwidth, and the eFLOPs conversion I = FLOP/s ÷ bytes/s.

Sparrow's paper converts memory traffic into "equivalent FLOPs" with a hardware factor I but gives
no number for it; the values here are our assumption from public datasheets (I ≈ 206 FLOP/byte on
H200), or from this workplace's own measurements for the `-measured` profiles.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float
    """Peak dense BF16 tensor-core FLOP/s (no 2:4 sparsity)."""
    bandwidth: float
    """Memory bandwidth, bytes/s."""
    source: str

    @property
    def intensity(self) -> float:
        """I in FLOP per byte: the arithmetic intensity at the roofline ridge, used to price bytes as eFLOPs."""
        return self.flops / self.bandwidth


HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware(
            "h100", 989.4e12, 3.35e12,
            "NVIDIA H100 SXM5 datasheet / Hopper architecture whitepaper: BF16 tensor 989.4 TFLOP/s dense "
            "(1,979 with sparsity), HBM3 3.35 TB/s",
        ),
        Hardware(
            "h200", 989.4e12, 4.8e12,
            "NVIDIA H200 SXM datasheet: BF16 tensor 1,979 TFLOP/s with sparsity (989.4 dense, same GH100 die "
            "as H100), HBM3e 4.8 TB/s",
        ),
        Hardware(
            "h100-measured", 798e12, 3.0e12,
            "this workplace's H100 SXM readings (shared/reference/kernels.md): 3.0 TB/s device copy, "
            "798 TFLOP/s bf16 GEMM",
        ),
        Hardware(
            "h200-measured", 798e12, 4.3e12,
            "this workplace's H200 readings (shared/reference/kernels.md): 4.3 TB/s device copy, "
            "769-798 TFLOP/s bf16 GEMM (upper value)",
        ),
    )
}


def resolve_hardware(name: str) -> Hardware:
    key = str(name).lower()
    if key not in HARDWARE:
        raise ValueError(f"unknown hardware {name!r}: choose one of {', '.join(HARDWARE)}")
    return HARDWARE[key]
