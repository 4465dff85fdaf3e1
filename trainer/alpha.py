"""Per-token acceptance α of the rollout against the dense recompute, aggregated per length bin.

Which length: generated token t (0-based) of a trajectory with P prompt tokens was sampled from the
forward pass whose context held L = P + t tokens (the prompt, the t tokens generated before it;
the token fed at that step is the last of them). That is the L the rollout schedule used to pick the
budget of that step (`SparsitySchedule`, "prompt + generated incl. the current token"), so token t
goes to bin `schedule.bin_of(P + t)`. Token 0 comes from the dense prefill and lands in bin_of(P).

α is bracketed from the two top-k lists (`acceptance_bounds_topk`): the lower bound is Sparrow's
statistic, the upper bound adds the mass the unlisted tokens could still share. Histograms are kept
per rollout schedule version, since the controller judges each schedule by its own rollouts.
"""

from dataclasses import dataclass, field

import torch

from sparrow.acceptance import AlphaHistogram, acceptance_bounds_topk, token_context_lengths
from sparrow.schedule import SparsitySchedule

from .batch import Trajectory
from .collectives import all_gather_objects
from .microbatch import MicroBatch


@dataclass
class AlphaReport:
    """α histograms (lower and upper bound) per rollout schedule version."""

    num_length_bins: int
    lower: dict[int, AlphaHistogram] = field(default_factory=dict)
    upper: dict[int, AlphaHistogram] = field(default_factory=dict)
    nonfinite: int = 0
    """Loss tokens left out because their α was NaN/Inf (non-finite logits: the step's update is then skipped and
    its weights are not published), so one bad step cannot poison the histograms or stop the job."""
    unmeasured: int = 0
    """Response tokens an exact measurement left out: their rollout schedule version is no longer known to the trainer."""

    def _pair(self, version: int) -> tuple[AlphaHistogram, AlphaHistogram]:
        if version not in self.lower:
            self.lower[version] = AlphaHistogram.empty(self.num_length_bins)
            self.upper[version] = AlphaHistogram.empty(self.num_length_bins)
        return self.lower[version], self.upper[version]

    def add(self, version: int, lower: torch.Tensor, upper: torch.Tensor, bins: torch.Tensor) -> None:
        lo, up = self._pair(version)
        lo.add(lower, bins)
        up.add(upper, bins)

    def merge(self, other: "AlphaReport") -> "AlphaReport":
        out = AlphaReport(self.num_length_bins, nonfinite=self.nonfinite + other.nonfinite,
                          unmeasured=self.unmeasured + other.unmeasured)
        for report in (self, other):
            for v in report.lower:
                lo, up = out._pair(v)
                out.lower[v], out.upper[v] = lo.merge(report.lower[v]), up.merge(report.upper[v])
        return out

    def tokens(self) -> int:
        return sum(int(h.count().sum()) for h in self.lower.values())

    def combined(self) -> tuple[AlphaHistogram, AlphaHistogram]:
        """All schedule versions together."""
        lo, up = AlphaHistogram.empty(self.num_length_bins), AlphaHistogram.empty(self.num_length_bins)
        for v in self.lower:
            lo, up = lo.merge(self.lower[v]), up.merge(self.upper[v])
        return lo, up


def add_trajectory_alpha(
    report: AlphaReport,
    trajectory: Trajectory,
    dense_top_ids: torch.Tensor,
    dense_top_logprobs: torch.Tensor,
    schedule: SparsitySchedule,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Add one trajectory's loss tokens; returns its per-token (lower, upper), or None without rollout top-k."""
    if trajectory.top_ids is None:
        return None
    lower, upper = acceptance_bounds_topk(
        dense_top_ids.cpu(), dense_top_logprobs.cpu().float(), trajectory.top_ids, trajectory.top_logprobs.float()
    )
    mask = trajectory.response_mask()
    keep = mask & torch.isfinite(lower) & torch.isfinite(upper)
    report.nonfinite += int(mask.sum() - keep.sum())
    bins = schedule.bins_for_lengths(token_context_lengths(trajectory.prompt_len, trajectory.response_len))
    report.add(trajectory.schedule_version, lower[keep], upper[keep], bins[keep])
    return lower, upper


def add_micro_batch_alpha(
    report: AlphaReport,
    mb: MicroBatch,
    trajectories: list[Trajectory],
    dense_top_ids: torch.Tensor,
    dense_top_logprobs: torch.Tensor,
    schedule: SparsitySchedule,
    bounds: dict[str, list] | None = None,
) -> None:
    """`add_trajectory_alpha` for every row of `mb`; with `bounds`, each row's per-token (lower, upper) goes into
    `bounds["alpha_lower"]` / `bounds["alpha_upper"]` at its index (None without rollout top-k)."""
    for i, ids, lp in zip(mb.indices, mb.per_row(dense_top_ids), mb.per_row(dense_top_logprobs)):
        pair = add_trajectory_alpha(report, trajectories[i], ids, lp, schedule)
        if bounds is not None:
            bounds["alpha_lower"][i], bounds["alpha_upper"][i] = pair if pair is not None else (None, None)


def merged_over_ranks(report: AlphaReport) -> AlphaReport:
    """Every rank's report merged (collective: all ranks call it)."""
    merged = AlphaReport(report.num_length_bins)
    for part in all_gather_objects(report):
        merged = merged.merge(part)
    return merged
