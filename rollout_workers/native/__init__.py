"""Sparrow's native rollout engine: paged KV cache with block landmarks, block-sparse decode under a
sparsity schedule, continuous batching, prefix sharing within GRPO groups. CPU default; CUDA-ready."""

from .config import NativeEngineConfig
from .engine import NativeEngine
from .model import DecoderModel
from .model_loader import load_model
from .model_spec import ModelLoadError, ModelSpec, load_spec
from .teacher_forced import TeacherForcedOutput, teacher_forced_logprobs
from .weights import WeightsError

__all__ = [
    "DecoderModel",
    "ModelLoadError",
    "ModelSpec",
    "NativeEngine",
    "NativeEngineConfig",
    "TeacherForcedOutput",
    "WeightsError",
    "load_model",
    "load_spec",
    "teacher_forced_logprobs",
]
