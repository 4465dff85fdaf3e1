"""New policy weights for vLLM: checked against the checkpoint it serves, and written as one it can load.

vLLM reloads in place tensor by tensor, so an update is checked whole before any of it is loaded: a bad tensor found
midway would leave the engine serving a mix of two policies (the engine contract keeps the old weights on any error).
"""

import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sparrow.finite import first_nonfinite

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TIED_HEAD = "lm_head.weight"


def checkpoint_shapes(model_dir: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name → (shape, safetensors dtype) of every tensor in a directory's safetensors files, from their headers."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors file; a weight update is checked against the served model's "
                         "safetensors (save a .bin model again with transformers' save_pretrained)")
    shapes = {}
    for f in files:
        with safe_open(str(f), "pt") as handle:
            for name in handle.keys():
                part = handle.get_slice(name)
                shapes[name] = (tuple(part.get_shape()), part.get_dtype())
    return shapes


def check_update(weights: Mapping[str, torch.Tensor] | Path, served_dir: Path, tied: bool) -> None:
    """Raise ValueError naming the tensor unless `weights` (a state dict, or a checkpoint directory, read from its
    headers) has the served checkpoint's names and shapes in floating dtypes, and a state dict only finite values.
    With tied embeddings an update may carry `lm_head.weight` or not."""
    served = {k: shape for k, (shape, _) in checkpoint_shapes(served_dir).items()}
    if isinstance(weights, Path):
        given = checkpoint_shapes(weights)
        bad_dtype = [k for k, (_, dtype) in given.items() if dtype not in ("F32", "BF16", "F16")]
        shapes, where = {k: shape for k, (shape, _) in given.items()}, f"checkpoint {weights}"
    else:
        bad = [k for k, v in weights.items() if not isinstance(v, torch.Tensor)]
        if bad:
            raise ValueError(f"state dict entries {bad[:5]} are not tensors")
        bad_dtype = [k for k, v in weights.items() if v.dtype not in FLOAT_DTYPES]
        shapes, where = {k: tuple(v.shape) for k, v in weights.items()}, "state dict"
    if bad_dtype:
        raise ValueError(f"{bad_dtype[0]}: the {where} holds it in a non-floating dtype; "
                         "send float32, bfloat16 or float16")
    if tied:
        served.pop(TIED_HEAD, None)
        shapes.pop(TIED_HEAD, None)
    missing, unexpected = sorted(served.keys() - shapes.keys()), sorted(shapes.keys() - served.keys())
    if missing or unexpected:
        raise ValueError(f"the {where} does not match the served model ({served_dir}): missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}")
    for name, shape in shapes.items():
        if shape != served[name]:
            raise ValueError(f"{name}: shape {shape} in the {where}, the served model's is {served[name]}")
    if not isinstance(weights, Path) and (name := first_nonfinite(weights)) is not None:
        raise ValueError(f"{name}: contains NaN or inf values; the engine keeps the weights it serves")


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
