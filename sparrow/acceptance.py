"""Per-token acceptance rate α = Σ_v min(p(v), q(v)) between the dense policy p and the sparse
rollout policy q, and its aggregation per length bin.

α = 1 − TV(p, q). Sparrow's training signal is the 5th percentile of α per 2000-token length bin.
From two full distributions α is exact. From two top-k lists it is bracketed: the lower bound counts
only tokens in both lists (Sparrow's statistic); the upper bound adds the largest mass the unseen
tokens could still share, using each side's residual mass 1 − Σ top-k and its k-th probability.
"""

from dataclasses import dataclass

import torch


def token_context_lengths(prompt_len: int, response_len: int) -> torch.Tensor:
    """The length a generated token's α is binned at: token t was drawn by the pass whose context held
    L = prompt_len + t tokens (the trainer's α histograms and calibration both bin by it)."""
    return prompt_len + torch.arange(response_len)


def acceptance_exact(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """α from full log-distributions `[..., V]` → `[...]`."""
    acc = torch.promote_types(logp.dtype, torch.float32)
    return torch.minimum(logp.to(acc).exp(), logq.to(acc).exp()).sum(-1).clamp(0.0, 1.0)


def acceptance_bounds_topk(
    p_ids: torch.Tensor,
    p_logprobs: torch.Tensor,
    q_ids: torch.Tensor,
    q_logprobs: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Guaranteed interval [lower, upper] for α from top-k lists `[..., K]` of each side.

    Entries with id < 0 are padding. The lists must be each side's highest-probability tokens, so an
    unseen token has probability at most that side's smallest listed one.
    """
    acc = torch.promote_types(p_logprobs.dtype, torch.float32)
    p = torch.where(p_ids >= 0, p_logprobs.to(acc).exp(), 0.0)
    q = torch.where(q_ids >= 0, q_logprobs.to(acc).exp(), 0.0)
    match = (p_ids[..., :, None] == q_ids[..., None, :]) & (p_ids >= 0)[..., :, None]  # [..., Kp, Kq]
    shared = torch.minimum(p[..., :, None], q[..., None, :]).masked_fill(~match, 0.0)
    lower = shared.sum((-1, -2))

    res_p = (1.0 - p.sum(-1)).clamp(min=0.0)
    res_q = (1.0 - q.sum(-1)).clamp(min=0.0)
    big = torch.finfo(acc).max
    p_kth = torch.where(p_ids >= 0, p, big).amin(-1).clamp(max=1.0)
    q_kth = torch.where(q_ids >= 0, q, big).amin(-1).clamp(max=1.0)
    p_only = (p_ids >= 0) & ~match.any(-1)
    q_only = (q_ids >= 0) & ~match.any(-2)
    # Tokens listed by p only: q(v) ≤ q's k-th prob, and together they hold at most q's residual.
    e1 = torch.minimum(torch.where(p_only, torch.minimum(p, q_kth[..., None]), 0.0).sum(-1), res_q)
    e2 = torch.minimum(torch.where(q_only, torch.minimum(q, p_kth[..., None]), 0.0).sum(-1), res_p)
    e3 = torch.minimum(res_p, res_q)  # tokens listed by neither side
    extra = torch.minimum(torch.minimum(e1 + e2 + e3, res_q + e2), res_p + e1)
    upper = (lower + extra).clamp(max=1.0)
    return lower.clamp(0.0, 1.0), upper


@dataclass
class AlphaHistogram:
    """Mergeable fixed-resolution histograms of α per length bin.

    `counts[b, j]` counts tokens of length bin b with α in [j/R, (j+1)/R) (α = 1 goes to the last
    cell); `sums[b]` keeps the exact mean. Adding the counts of two histograms merges them (across
    workers and steps). Percentiles interpolate inside a cell, so their error is at most 1/R
    (0.0005 at the default R = 2000).
    """

    counts: torch.Tensor
    sums: torch.Tensor

    @classmethod
    def empty(cls, num_length_bins: int = 20, resolution: int = 2000) -> "AlphaHistogram":
        return cls(
            counts=torch.zeros(num_length_bins, resolution, dtype=torch.long),
            sums=torch.zeros(num_length_bins, dtype=torch.float64),
        )

    @property
    def num_length_bins(self) -> int:
        return self.counts.shape[0]

    @property
    def resolution(self) -> int:
        return self.counts.shape[1]

    def add(self, alpha: torch.Tensor, length_bins: torch.Tensor) -> "AlphaHistogram":
        """Count tokens with acceptance `alpha` whose sequences were in `length_bins` (same shape)."""
        alpha = alpha.detach().flatten().double().cpu()
        bins = length_bins.detach().flatten().long().cpu()
        if alpha.shape != bins.shape:
            raise ValueError(f"alpha has {alpha.numel()} values but length_bins has {bins.numel()}")
        if not torch.isfinite(alpha).all():
            raise ValueError("alpha contains NaN or inf; fix the logprobs that produced it")
        if bins.numel() and (bins.min() < 0 or bins.max() >= self.num_length_bins):
            raise ValueError(f"length bin out of range [0, {self.num_length_bins}): {bins.min()}..{bins.max()}")
        alpha = alpha.clamp(0.0, 1.0)
        cell = (alpha * self.resolution).long().clamp(max=self.resolution - 1)
        self.counts.view(-1).index_add_(0, bins * self.resolution + cell, torch.ones_like(cell))
        self.sums.index_add_(0, bins, alpha)
        return self

    def merge(self, other: "AlphaHistogram") -> "AlphaHistogram":
        if other.counts.shape != self.counts.shape:
            raise ValueError(f"cannot merge histograms of shapes {tuple(other.counts.shape)} and {tuple(self.counts.shape)}")
        return AlphaHistogram(self.counts + other.counts, self.sums + other.sums)

    def count(self) -> torch.Tensor:
        return self.counts.sum(-1)

    def mean(self) -> torch.Tensor:
        n = self.count()
        return torch.where(n > 0, self.sums / n.clamp(min=1), float("nan"))

    def percentile(self, pct: float = 5.0) -> torch.Tensor:
        """Per length bin, the `pct`-th percentile of α (NaN where a bin is empty)."""
        if not 0.0 <= pct <= 100.0:
            raise ValueError(f"pct={pct}: must be within [0, 100]")
        n = self.count()
        cum = self.counts.cumsum(-1)
        rank = (pct / 100.0) * n.double()  # number of tokens at or below the percentile
        target = torch.maximum(rank, torch.ones_like(rank))
        cell = torch.searchsorted(cum.double().contiguous(), target[:, None].contiguous()).squeeze(-1)
        cell = cell.clamp(max=self.resolution - 1)
        below = torch.where(cell > 0, cum.gather(1, (cell - 1).clamp(min=0)[:, None]).squeeze(-1), 0)
        inside = self.counts.gather(1, cell[:, None]).squeeze(-1).clamp(min=1)
        frac = ((rank - below) / inside).clamp(0.0, 1.0)
        value = (cell.double() + frac) / self.resolution
        return torch.where(n > 0, value, float("nan"))

    def summary(self, pct: float = 5.0) -> list[dict]:
        p, m, n = self.percentile(pct), self.mean(), self.count()
        return [
            {"bin": b, "count": int(n[b]), "mean": float(m[b]), f"p{pct:g}": float(p[b])}
            for b in range(self.num_length_bins)
            if n[b] > 0
        ]

    def to_dict(self) -> dict:
        """Sparse form for transport: only non-empty cells."""
        nz = self.counts.nonzero()
        return {
            "shape": list(self.counts.shape),
            "cells": nz.tolist(),
            "values": self.counts[nz[:, 0], nz[:, 1]].tolist(),
            "sums": self.sums.tolist(),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "AlphaHistogram":
        hist = cls.empty(*data["shape"])
        if data["cells"]:
            idx = torch.tensor(data["cells"], dtype=torch.long)
            hist.counts[idx[:, 0], idx[:, 1]] = torch.tensor(data["values"], dtype=torch.long)
        hist.sums = torch.tensor(data["sums"], dtype=torch.float64)
        return hist
