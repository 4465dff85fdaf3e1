"""New policy weights for vLLM: checked whole against the checkpoint it serves (vLLM reloads in place tensor by
tensor), then handed to its worker through shared buffers, or written as a checkpoint it can load."""

import base64
import pickle
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

from sparrow.architecture import safetensors_files
from sparrow.weight_sync import SharedHandle
from sparrow.weight_sync.check import TensorHeader, check_update, read_headers

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
TIED_HEAD = "lm_head.weight"
MEMORY_BUCKET_BYTES = 256 << 20
"""Buckets of the shared buffers a state dict reaches vLLM's worker through (`weight_update: memory`)."""


def encode_handle(handle: SharedHandle) -> str:
    """A `SharedHandle` as text for `collective_rpc` (vLLM's RPC encoder takes no arbitrary objects; the handle
    holds file paths or CUDA IPC arguments, never tensor data)."""
    return base64.b64encode(pickle.dumps(handle)).decode()


def decode_handle(text: str) -> SharedHandle:
    return pickle.loads(base64.b64decode(text))


def checkpoint_headers(model_dir: Path) -> dict[str, TensorHeader]:
    """Name → shape and dtype of every tensor in a directory's safetensors files."""
    return read_headers(safetensors_files(model_dir, "a weight update is checked against the served model's "
                                                      "safetensors (save a .bin model again with transformers' "
                                                      "save_pretrained)"))


def served_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """What every update must match, read once: an accepted update has these shapes again."""
    return {name: header.shape for name, header in checkpoint_headers(model_dir).items()}


def check_fits_served(weights: Mapping[str, torch.Tensor] | Path, served: Mapping[str, tuple[int, ...]],
                      tied: bool) -> None:
    """Raise ValueError naming the tensor unless `weights` (a state dict, or a checkpoint directory by its headers)
    fits the served shapes (`sparrow.weight_sync.check`). With tied embeddings an update may carry the lm_head or
    not."""
    if isinstance(weights, Path):
        given, where = checkpoint_headers(weights), f"checkpoint {weights}"
    else:
        given, where = weights, "state dict"
    check_update(given, served, where=where, served="the served model", optional=(TIED_HEAD,) if tied else ())


def save_checkpoint(state_dict: Mapping[str, torch.Tensor], base_dir: Path, out_dir: Path) -> Path:
    """`out_dir` = the non-weight files of `base_dir` (config, tokenizer, generation config) plus
    `state_dict` as one safetensors file. Tensors sharing storage (tied embeddings) are copied so
    safetensors can write them."""
    if not state_dict:
        raise ValueError("load_weights got an empty state dict")
    out_dir.mkdir(parents=True)
    for f in Path(base_dir).iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"):
            shutil.copy2(f, out_dir / f.name)
    seen: set[int] = set()
    tensors = {}
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir
