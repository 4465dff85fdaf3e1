"""Reading HF safetensors checkpoints and swapping weights in place, all-or-nothing.

`validated_weights` checks a whole state dict against the model before anything is copied, so a bad
update (missing or unexpected key, wrong shape or dtype, NaN/inf) raises naming the key and the
engine keeps serving the old weights.
"""

import json
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from .model import DecoderModel
from .model_spec import ModelLoadError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Non-parameter buffers some older checkpoints carry; recomputed from the config instead."""


class WeightsError(ValueError):
    """A state dict that does not fit the model; the message names the key."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({exc.__class__.__name__}: {exc})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: listed in {index.name} but missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors file; the native engine reads safetensors checkpoints only")
    return files


def read_checkpoint(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory's safetensors files (on CPU)."""
    model_dir = Path(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(model_dir):
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"{f}: corrupt or unreadable safetensors file ({exc})") from None
    return tensors


def _names(keys, limit: int = 8) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def validated_weights(model: DecoderModel, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors to copy into `model`, keyed like `model.named_parameters()`; raises WeightsError."""
    params = dict(model.named_parameters())
    given = {k: v for k, v in weights.items() if not k.endswith(IGNORED_SUFFIXES)}
    tied_head = given.pop("lm_head.weight", None) if model.lm_head is None else None
    missing, unexpected = params.keys() - given.keys(), given.keys() - params.keys()
    if missing or unexpected:
        parts = ([f"missing keys: {_names(missing)}"] if missing else []) + (
            [f"unexpected keys: {_names(unexpected)}"] if unexpected else []
        )
        raise WeightsError(f"state dict does not match the {model.spec.family} model: " + "; ".join(parts))
    out = {}
    for name, param in params.items():
        t = given[name]
        if not isinstance(t, torch.Tensor):
            raise WeightsError(f"{name}: expected a tensor, got {type(t).__name__}")
        if t.dtype not in FLOAT_DTYPES:
            raise WeightsError(f"{name}: dtype {t.dtype} is not a floating weight type (float32, bfloat16, float16)")
        if tuple(t.shape) != tuple(param.shape):
            raise WeightsError(f"{name}: shape {tuple(t.shape)} does not match the model's {tuple(param.shape)}")
        if not bool(torch.isfinite(t).all()):
            raise WeightsError(f"{name}: contains NaN or inf values")
        out[name] = t
    if tied_head is not None:
        embed = out["model.embed_tokens.weight"]
        if tied_head.shape != embed.shape or not torch.equal(tied_head.to(embed.device, embed.dtype), embed):
            raise WeightsError(
                "lm_head.weight: differs from model.embed_tokens.weight, but this model ties them "
                "(tie_word_embeddings=true); send equal tensors or drop lm_head.weight"
            )
    return out


@torch.no_grad()
def copy_weights(model: DecoderModel, tensors: Mapping[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    for name, t in tensors.items():
        params[name].copy_(t)
