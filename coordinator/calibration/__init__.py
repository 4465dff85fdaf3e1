"""`sparrow calibrate`: measure the tail acceptance α per (length bin, KV budget) with sparse
rollouts and exact dense/sparse recomputes, and pick the cheapest schedule meeting τ
(docs/calibration.md). `config`, `plan`, `measure`, `table`, `report` are pure; `runner` and `plot`
do the I/O."""

from .config import CalibrationConfig
from .measure import BudgetRun, SampleAlpha, sample_alpha
from .plan import (
    PAPER_BUDGETS, SHORT_BUDGETS, bin_edges, calibration_template, default_budgets, fixed_budget_schedule,
    sparse_token_mask, token_length_bins,
)
from .table import CalibrationResult, Cell, alpha_table, assemble, budget_table, measurement_file

__all__ = [
    "PAPER_BUDGETS", "SHORT_BUDGETS", "BudgetRun", "CalibrationConfig", "CalibrationResult", "Cell", "SampleAlpha",
    "alpha_table", "assemble", "bin_edges", "budget_table", "calibration_template", "default_budgets",
    "fixed_budget_schedule", "measurement_file", "sample_alpha", "sparse_token_mask", "token_length_bins",
]
