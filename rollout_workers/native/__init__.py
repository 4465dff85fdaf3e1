"""Sparrow's native rollout engine: paged KV cache with block landmarks, block-sparse decode under a
sparsity schedule, continuous batching, prefix sharing within GRPO groups. CPU default; CUDA-ready."""

from .config import NativeEngineConfig
from .engine import NativeEngine
from .model import DecoderModel
from .model_loader import load_model
from .model_spec import ModelLoadError, ModelSpec, load_spec
from .prompt_recompute import PromptRecompute
from .teacher_forced import teacher_forced_logprobs
from .weights import WeightsError

__all__ = [
    "DecoderModel",
    "ModelLoadError",
    "ModelSpec",
    "PromptRecompute",
    "NativeEngine",
    "NativeEngineConfig",
    "WeightsError",
    "load_model",
    "load_spec",
    "teacher_forced_logprobs",
]
