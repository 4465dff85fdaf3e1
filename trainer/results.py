"""What trainer calls return (plain dataclasses: they cross Ray and process boundaries)."""

from dataclasses import dataclass, field

import torch

from .alpha import AlphaReport


@dataclass
class StepResult:
    metrics: dict[str, float]
    """Global over all ranks (see docs/trainer.md for the list)."""
    alpha: AlphaReport
    """α of the rollouts against π_old, per rollout schedule version, all ranks merged."""
    gradients: dict[str, torch.Tensor] | None = None
    """Full gradients of the last mini-batch before the optimizer step (only when asked for)."""
    alpha_exact: AlphaReport | None = None
    """Exact α of the same tokens against π_old (`TrainerConfig.exact_alpha`), all ranks merged."""


@dataclass
class RecomputeResult:
    """Per trajectory of the batch given (same order): the dense policy's view of each response token."""

    logprobs: list[torch.Tensor]
    entropy: list[torch.Tensor]
    top_ids: list[torch.Tensor]
    top_logprobs: list[torch.Tensor]
    alpha_lower: list[torch.Tensor | None]
    alpha_upper: list[torch.Tensor | None]
    alpha: AlphaReport
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def merge(cls, parts: list[tuple[list[int], "RecomputeResult"]], size: int) -> "RecomputeResult":
        """Reassemble shards computed on several ranks into the original order."""
        fields = ("logprobs", "entropy", "top_ids", "top_logprobs", "alpha_lower", "alpha_upper")
        out = {f: [None] * size for f in fields}
        for indices, part in parts:
            for f in fields:
                for i, value in zip(indices, getattr(part, f)):
                    out[f][i] = value
        first = parts[0][1]
        return cls(**out, alpha=first.alpha, metrics=first.metrics)
