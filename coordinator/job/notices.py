"""`Notices`: what the job tells its user beside the progress line — short, and once where it would repeat.

The run's report (RUN_DIR/report/report.md) carries the detail and the advice; a line here only says that
something needs a look and where.
"""

from ..step_record import StepRecord


LONG_TAIL_SHARE = 0.5
"""A rollout that spent at least this share of its time below half its peak batch is mostly its long tail."""


class Notices:
    def __init__(self, log, logprobs: int, statistic: str, hint_long_tail: bool = False):
        self.log, self.logprobs, self.statistic = log, logprobs, statistic
        self.loose_tail_said = False
        self.long_tail_said = not hint_long_tail
        """Said once; only to GPU engines without partial rollouts (a CPU decode step's cost grows with the batch,
        so a fuller batch buys nothing there)."""

    def after_step(self, record: StepRecord) -> None:
        self._numerical_guards(record)
        self._loose_tail(record)
        self._long_tail(record)

    def _numerical_guards(self, record: StepRecord) -> None:
        """An update the trainer skipped (non-finite gradients) or α tokens it left out: each time, they are rare."""
        skipped = int(record.train.get("train/skipped_updates", 0))
        nonfinite = int(record.train.get("train/alpha_nonfinite_tokens", 0))
        if skipped:
            self.log(f"step {record.step + 1}: {skipped} optimizer update(s) skipped: non-finite loss or gradients "
                     "(the weights are unchanged by them; counted in sparrow_train_skipped_updates)")
        if nonfinite:
            self.log(f"step {record.step + 1}: {nonfinite} tokens with a non-finite α (non-finite logits) left out of "
                     "the α histograms")

    def _loose_tail(self, record: StepRecord) -> None:
        """Once per job: the top-k lists cannot pin down the tail, so the controller's statistic is not α itself."""
        loose = record.alpha.loose_bins()
        if not loose or self.loose_tail_said or self.statistic == "exact":
            return
        self.loose_tail_said = True
        worst = max(record.alpha.bound_gaps[b] for b in loose)
        self.log(f"step {record.step + 1}: α's tail is only bracketed in bins {loose} (top-{self.logprobs} bounds up to "
                 f"{worst:.2f} apart); the controller steers on the {self.statistic!r} bound. Said once; "
                 "RUN_DIR/report/report.md has each step's bounds and what to change")

    def _long_tail(self, record: StepRecord) -> None:
        """Once per job, after the warm-up step: most of the rollout was a few long samples decoding alone."""
        share = record.rollout.tail_share
        if self.long_tail_said or record.step < 1 or share is None or share < LONG_TAIL_SHARE:
            return
        self.long_tail_said = True
        self.log(f"step {record.step + 1}: {share:.0%} of the rollout ran below half its peak batch (a few long samples "
                 "decoding alone); run.partial_rollout may shorten the step (close_after_s with extra_groups 0 needs no "
                 "tuning), and `sparrow bench tail-model` estimates by how much for your lengths (docs/coordinator.md, "
                 "The long tail). Said once")
