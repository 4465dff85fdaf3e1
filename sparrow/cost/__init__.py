"""Decode cost of dense vs block-sparse rollouts (Sparrow's paper forms and a schedule-aware sum),
and the schedule optimiser built on it. Pure functions; the only I/O is reading an HF config.json."""

from .hardware import HARDWARE, Hardware, resolve_hardware
from .optimise import BinChoice, OptimisedSchedule, alpha_tail_from_histograms, optimise_schedule
from .paper import PaperCost, appf_context_sum, appf_cost, sec33_dense, sec33_scoring, sec33_sparse
from .rollout import Comparison, CostModel, RolloutCost, RolloutSpec, StepCosts, schedule_bins
from .shapes import BUILTIN_MODELS, ModelShape, resolve_model

__all__ = [
    "BUILTIN_MODELS", "HARDWARE", "BinChoice", "Comparison", "CostModel", "Hardware", "ModelShape",
    "OptimisedSchedule", "PaperCost", "RolloutCost", "RolloutSpec", "StepCosts", "alpha_tail_from_histograms",
    "appf_context_sum", "appf_cost", "optimise_schedule", "resolve_hardware", "resolve_model", "schedule_bins",
    "sec33_dense", "sec33_scoring", "sec33_sparse",
]
