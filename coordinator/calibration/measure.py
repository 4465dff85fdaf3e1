"""Per-token α of one rollout sample, and its accumulation per budget. Pure tensor code.

Calibration runs offline, so α is exact: Σ_v min(p(v), q(v)) over the whole vocabulary, from a
dense and a sparse teacher-forced recompute of the sample's tokens. Training sees only the two
top-K lists; their interval [lower, upper] (`acceptance_bounds_topk`, lower = Sparrow's statistic)
is recorded beside it to show how far the statistic the controller acts on sits from the truth.
"""

from dataclasses import dataclass, field
from typing import Literal

import torch

from sparrow.acceptance import AlphaHistogram, acceptance_bounds_topk, acceptance_exact


REPLAY_TOLERANCE = 1e-3
"""|Δlog q| above which the sparse recompute did not reproduce the engine's distribution."""

Statistic = Literal["exact", "lower", "upper"]
STATISTICS: tuple[Statistic, ...] = ("exact", "lower", "upper")


@dataclass(frozen=True)
class SampleAlpha:
    exact: torch.Tensor
    """`[G]` α from the full dense and sparse distributions."""
    lower: torch.Tensor
    """`[G]` lower bound from the rollout's top-K and the dense top-K (what training measures)."""
    upper: torch.Tensor


def sample_alpha(
    dense_logprobs: torch.Tensor,
    sparse_logprobs: torch.Tensor,
    rollout_top_ids: torch.Tensor,
    rollout_top_logprobs: torch.Tensor,
) -> SampleAlpha:
    """`[G, V]` dense and sparse log-distributions and the rollout's `[G, K]` top-K lists → per-token α."""
    if dense_logprobs.shape != sparse_logprobs.shape:
        raise ValueError(f"dense {tuple(dense_logprobs.shape)} and sparse {tuple(sparse_logprobs.shape)} log-probs differ in shape")
    exact = acceptance_exact(dense_logprobs, sparse_logprobs).cpu()
    k = rollout_top_ids.shape[-1]
    if k == 0:
        return SampleAlpha(exact, exact.new_full(exact.shape, float("nan")), exact.new_full(exact.shape, float("nan")))
    dense_top = dense_logprobs.float().topk(k, dim=-1)
    lower, upper = acceptance_bounds_topk(
        dense_top.indices.cpu(), dense_top.values.cpu(), rollout_top_ids.cpu(), rollout_top_logprobs.float().cpu()
    )
    return SampleAlpha(exact, lower, upper)


@dataclass
class BudgetRun:
    """Everything measured at one total budget in blocks (None = the dense baseline)."""

    budget: int | None
    num_bins: int
    exact: AlphaHistogram = field(init=False)
    lower: AlphaHistogram = field(init=False)
    upper: AlphaHistogram = field(init=False)
    samples: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    tokens: int = 0
    sparse_tokens: int = 0
    """Tokens whose producing pass attended fewer blocks than its context held."""
    replay_max_error: float = 0.0
    """Largest |log q| difference between the engine and the sparse recompute of the sampled token."""
    replay_tokens_off: int = 0
    """Tokens whose |Δlog q| exceeds REPLAY_TOLERANCE: the recompute picked other blocks (near-tied scores), or, with the
    same blocks, the kernels round differently (bfloat16 on a GPU: most tokens)."""
    replay_block_mismatches: int = 0
    """Tokens whose recomputed blocks attended differ from the engine's (0 = exact replay)."""
    generate_seconds: float = 0.0
    recompute_seconds: float = 0.0
    length_sums: torch.Tensor = field(init=False)
    """`[num_bins]` sum of the total lengths L of the tokens counted per bin (where the bin's tokens sit)."""

    def __post_init__(self):
        self.exact, self.lower, self.upper = (AlphaHistogram.empty(self.num_bins) for _ in range(3))
        self.length_sums = torch.zeros(self.num_bins, dtype=torch.float64)

    def histogram(self, statistic: Statistic) -> AlphaHistogram:
        if statistic not in STATISTICS:
            raise ValueError(f"statistic={statistic!r}: use one of {', '.join(STATISTICS)}")
        return getattr(self, statistic)

    @property
    def label(self) -> str:
        return "dense" if self.budget is None else str(self.budget)

    def add_sample(
        self,
        alpha: SampleAlpha,
        bins: torch.Tensor,
        sparse: torch.Tensor,
        replay_error: torch.Tensor,
        block_mismatches: int,
        lengths: torch.Tensor | None = None,
    ) -> None:
        """`replay_error`: per token, |log q| of the engine minus that of the sparse recompute;
        `lengths`: per token, the total length L of the pass that produced it."""
        self.exact.add(alpha.exact, bins)
        if lengths is not None:
            self.length_sums.index_add_(0, bins.long(), lengths.to(torch.float64))
        if not torch.isnan(alpha.lower).any():
            self.lower.add(alpha.lower, bins)
            self.upper.add(alpha.upper, bins)
        self.samples += 1
        self.tokens += int(bins.numel())
        self.sparse_tokens += int(sparse.sum())
        if replay_error.numel():
            self.replay_max_error = max(self.replay_max_error, float(replay_error.max()))
            self.replay_tokens_off += int((replay_error > REPLAY_TOLERANCE).sum())
        self.replay_block_mismatches += int(block_mismatches)

    def add_failure(self, error: str) -> None:
        self.failed += 1
        if error not in self.errors:
            self.errors.append(error)
