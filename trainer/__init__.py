"""The dense-policy trainer: DeepSpeed ranks that recompute dense log-probs, measure α against the
sparse rollouts, update the policy with GRPO + TIS, optionally distil a sparse-attention LoRA, and
publish weights to rollout workers (docs/trainer.md).

`TrainerGroup` (Ray actors) lives in `sparrow.trainer.group`, so importing this package does not
import Ray.
"""

from .advantages import grpo_advantages
from .alpha import AlphaReport
from .batch import Trajectory, TrajectoryBatch
from .config import DistillSparseConfig, LossConfig, OptimizerConfig, PublishConfig, TrainerConfig, TrainerSettings
from .losses import k3_kl, policy_loss
from .rank import TrainerRank
from .results import RecomputeResult, StepResult

__all__ = [
    "AlphaReport",
    "DistillSparseConfig",
    "LossConfig",
    "OptimizerConfig",
    "PublishConfig",
    "RecomputeResult",
    "StepResult",
    "TrainerConfig",
    "TrainerSettings",
    "TrainerRank",
    "Trajectory",
    "TrajectoryBatch",
    "grpo_advantages",
    "k3_kl",
    "policy_loss",
]
