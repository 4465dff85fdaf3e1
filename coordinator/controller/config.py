"""Settings of the closed-loop sparsity controller (docs/controller.md explains each one)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SPARROW_LADDER = (29, 45, 61, 77, 93, 125, 157, 189, 221, 253, 317, 381, 445, 509, 637, 765, 893, 1021)
"""Top-k blocks of Sparrow's 18 profiled configurations (16-token pages × 32 … 1024 pages, minus the
sink and two recent blocks)."""


class ControllerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    target: float = Field(0.86, gt=0.0, lt=1.0, description="τ: the tail α every length bin must keep")
    percentile: float = Field(5.0, gt=0.0, le=50.0, description="which percentile of α is the tail (Sparrow: 5)")
    statistic: Literal["lower", "upper", "midpoint", "exact"] = Field(
        "lower", description="act on the top-k lower bound of α (Sparrow's statistic), the upper bound, their mean, or "
        "exact α (measured by the trainer each step; needs trainer.exact_alpha)"
    )
    confidence_z: float = Field(
        1.0, ge=0.0, le=5.0,
        description="decisions use a lower confidence bound of the percentile, z standard errors of its rank below",
    )
    ladder: list[int] = Field(default_factory=lambda: list(SPARROW_LADDER), description="allowed top-k block counts")
    ladder_step: int | None = Field(
        None, ge=1, description="continuous budgets: every multiple of this many blocks between min and max of ladder"
    )
    min_samples: int = Field(2000, ge=1, description="tokens a bin needs at its current budget before it is judged")
    window_steps: int = Field(4, ge=1, description="steps of measurements pooled per bin while its budget holds")
    raise_margin: float = Field(0.01, ge=0.0, lt=0.5, description="a raise aims for predicted α ≥ τ + raise_margin")
    lower_margin: float = Field(0.01, ge=0.0, lt=0.5, description="headroom: a bin may lower only while α ≥ τ + lower_margin")
    lower_patience: int = Field(3, ge=1, description="consecutive judged steps with headroom before lowering")
    cooldown_steps: int = Field(3, ge=0, description="steps after any change of a bin before it may lower")
    max_raise_levels: int = Field(6, ge=1, description="largest raise per step, in ladder levels (emergencies excepted)")
    max_lower_levels: int = Field(1, ge=1, description="largest lowering per step, in ladder levels")
    max_violation_steps: int = Field(
        3, ge=1, description="judged steps a bin may stay below τ; then it jumps to a level known to be safe, or dense"
    )
    dense_retry_steps: int = Field(50, ge=1, description="steps a bin stays dense after the ladder top failed, before retrying it")
    max_dense_retry_steps: int = Field(800, ge=1, description="cap of the doubling retry interval")
    model_memory_steps: int = Field(200, ge=1, description="steps a measurement at a budget not in use is remembered")
    prior_slope: float = Field(
        0.06, gt=0.0, le=1.0, description="α gained per doubling of the budget, assumed until a bin has two measured budgets"
    )
    monotone_in_length: bool = Field(False, description="keep budgets non-decreasing from short to long bins")
    warm_start: str = Field("dense", description="initial schedule: 'dense', a published schedule name, or a schedule file")
    calibration: str | None = Field(
        None, description="calibration file (α tail per bin and budget); when set, the optimiser picks the initial schedule"
    )

    @model_validator(mode="after")
    def _consistent(self):
        if not self.ladder:
            raise ValueError("ladder is empty; give the allowed top-k block counts, e.g. [29, 45, 61, ...]")
        bad = [v for v in self.ladder if v < 0]
        if bad:
            raise ValueError(f"ladder contains {bad}; top-k block counts must be >= 0")
        if any(b <= a for a, b in zip(self.ladder, self.ladder[1:])):
            raise ValueError(f"ladder={self.ladder} must be strictly increasing (cheapest budget first)")
        if self.ladder_step is not None and len(self.ladder) < 2:
            raise ValueError("ladder_step needs a ladder with at least its min and max, e.g. ladder: [29, 1021]")
        if self.max_dense_retry_steps < self.dense_retry_steps:
            raise ValueError(
                f"max_dense_retry_steps={self.max_dense_retry_steps} is below dense_retry_steps={self.dense_retry_steps}; "
                "raise it or lower dense_retry_steps"
            )
        if self.target + self.lower_margin >= 1.0:
            raise ValueError(
                f"target + lower_margin = {self.target + self.lower_margin:g} >= 1: no bin could ever show headroom; "
                "lower one of them"
            )
        return self

    def levels(self) -> tuple[int, ...]:
        """The top-k block counts the controller may choose, cheapest first (dense comes after the last)."""
        if self.ladder_step is None:
            return tuple(self.ladder)
        lo, hi, step = self.ladder[0], self.ladder[-1], self.ladder_step
        return tuple(sorted({lo, hi, *range(-(-lo // step) * step, hi, step)}))
