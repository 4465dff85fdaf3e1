"""Where a profiled decode step's time goes: its kernels grouped by job, each group beside the bytes it must move.

A group's floor is those bytes at the measured copy bandwidth (`floor.step_bytes`): the weights for the GEMMs, the
K/V for attention, the landmarks plus the fp32 scores written for scoring, the scores read back for selection. The
merge, the small fused kernels and the idle time between kernels have no bytes of their own to move, so all of
their time is above the floor. Summed, the rows give the profiled span against the step's floor.
"""

KERNEL_KINDS = (
    ("attention", ("_decode_attention_kernel",)),
    ("scoring", ("_score_kernel",)),
    ("selection", ("_select_kernel",)),
    ("merge", ("_merge_splits_kernel",)),
    ("GEMMs", ("nvjet", "gemm", "cublas", "splitKreduce", "cutlass", "xmma")),
)
"""Kernel-name fragments per group, first match wins: our Triton kernels by their function names, the weight GEMMs by
cuBLAS's kernel families (the split-K reduce included); every other kernel is `other`."""
OTHER = "other"
IDLE = "idle between kernels"


def kernel_kind(name: str) -> str:
    return next((kind for kind, parts in KERNEL_KINDS if any(part in name for part in parts)), OTHER)


def kernel_kinds(kernels: list[tuple[str, int, float]]) -> dict[str, dict]:
    """`(name, calls, µs)` of a profile's kernels summed per group (`KERNEL_KINDS` order, then `other`)."""
    kinds = {kind: {"calls": 0, "us": 0.0} for kind, _ in KERNEL_KINDS}
    kinds[OTHER] = {"calls": 0, "us": 0.0}
    for name, calls, us in kernels:
        group = kinds[kernel_kind(name)]
        group["calls"] += calls
        group["us"] += us
    return kinds


def floor_bytes(kind: str, nbytes: dict) -> int | None:
    """The bytes group `kind` must move in a step of `nbytes` (`step_bytes`); None where it moves none of its own."""
    half_scores = nbytes["scores"] // 2  # fp32 scores: written once by scoring, read once by selection
    return {"GEMMs": nbytes["weights"], "attention": nbytes["dense_kv"] + nbytes["sparse_kv"],
            "scoring": nbytes["landmarks"] + half_scores, "selection": half_scores}.get(kind)


def step_breakdown(kinds: dict[str, dict], gap_us: float, nbytes: dict, copy_gbps: float) -> list[dict]:
    """One row per group with kernels, then the idle time: calls, µs, floor µs (None: nothing of its own to move)
    and µs above the floor."""
    rows = []
    for kind, group in kinds.items():
        if not group["calls"]:
            continue
        moved = floor_bytes(kind, nbytes)
        floor_us = None if moved is None else moved / copy_gbps / 1e3
        rows.append({"kind": kind, "calls": group["calls"], "us": group["us"], "floor_us": floor_us,
                     "above_us": group["us"] - (floor_us or 0.0)})
    rows.append({"kind": IDLE, "calls": 0, "us": gap_us, "floor_us": None, "above_us": gap_us})
    return rows
