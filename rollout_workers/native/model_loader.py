"""Where the native engine's model comes from: a device and dtype by name, and an HF directory's weights."""

from pathlib import Path

import torch
from torch import distributed as dist

from .model import DecoderModel
from .model_spec import ModelLoadError, load_spec
from .tensor_parallel import TensorParallel
from .weights import load_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: CUDA is not available on this machine; use device='cpu'")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_model(model_dir: str | Path, device="cpu", dtype=torch.float32, max_model_len: int | None = None,
               tensor_parallel_size: int = 1, process_group: dist.ProcessGroup | None = None) -> DecoderModel:
    """An HF directory's model with its weights, ready for the engine or `teacher_forced_logprobs`; with
    `tensor_parallel_size` > 1, this rank's shard (its rank in `process_group`, default: the default group)."""
    spec = load_spec(model_dir)
    max_len = max_model_len or spec.max_position_embeddings
    if max_len > spec.max_position_embeddings:
        raise ModelLoadError(
            f"max_model_len={max_len} exceeds the model's max_position_embeddings={spec.max_position_embeddings} "
            f"({Path(model_dir) / 'config.json'}); lower max_model_len"
        )
    tensor_parallel = TensorParallel.join(spec, tensor_parallel_size, process_group)
    model = DecoderModel(spec, max_len, device=device, dtype=dtype, tensor_parallel=tensor_parallel)
    load_weights(model, model_dir)
    return model
