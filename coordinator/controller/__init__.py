"""Closed-loop sparsity controller: keeps each length bin's tail α ≥ τ at the least KV budget.
Pure state machine (no I/O); see docs/controller.md."""

from .config import SPARROW_LADDER, ControllerConfig
from .controller import REASONS, ControlStep, Decision, SparsityController
from .simulation import PowerLawResponse, Simulator, TableResponse, Trace, cheapest_levels, simulate
from .tail import TailEstimate, tail_estimate
from .warm_start import initial_schedule

__all__ = [
    "REASONS", "SPARROW_LADDER", "ControlStep", "ControllerConfig", "Decision", "PowerLawResponse", "Simulator",
    "SparsityController", "TableResponse", "TailEstimate", "Trace", "cheapest_levels", "initial_schedule", "simulate",
    "tail_estimate",
]
