"""Reading HF safetensors checkpoints and swapping weights in place, all-or-nothing.

`validated_weights` checks a whole state dict against the model before anything is copied, so a bad
update (missing or unexpected key, wrong shape or dtype, NaN/inf) raises naming the key and the
engine keeps serving the old weights. Under tensor parallelism a rank takes its shard of each tensor
first (`tensor_parallel.py`) and validates that.
"""

from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from sparrow.architecture import ModelConfigError, safetensors_files
from sparrow.weight_sync.check import check_update

from .model import DecoderModel
from .model_spec import ModelLoadError, WeightsError

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Non-parameter buffers some older checkpoints carry; recomputed from the config instead."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    try:
        return safetensors_files(model_dir, "the native engine reads safetensors checkpoints only")
    except ModelConfigError as exc:
        raise ModelLoadError(str(exc)) from None


def read_checkpoint(model_dir: str | Path, shard: Callable | None = None) -> dict[str, torch.Tensor]:
    """All tensors of an HF directory's safetensors files (on CPU); with `shard(name, safetensors_slice)`,
    only the part of each tensor it takes is read (a tensor-parallel rank reads its shard, not the model)."""
    model_dir = Path(model_dir)
    tensors: dict[str, torch.Tensor] = {}
    for f in checkpoint_files(model_dir):
        try:
            if shard is None:
                tensors.update(load_file(str(f)))
                continue
            with safe_open(str(f), "pt") as handle:
                tensors.update({name: shard(name, handle.get_slice(name)) for name in handle.keys()})
        except WeightsError:
            raise
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"{f}: corrupt or unreadable safetensors file ({exc})") from None
    return tensors


def validated_weights(model: DecoderModel, weights: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors to copy into `model`, keyed like `model.named_parameters()`; raises WeightsError."""
    params = dict(model.named_parameters())
    given = {k: v for k, v in weights.items() if not k.endswith(IGNORED_SUFFIXES)}
    tied_head = given.pop("lm_head.weight", None) if model.lm_head is None else None
    shard = "" if model.tensor_parallel is None else " (shapes of this tensor-parallel rank's shard)"
    check_update(given, {name: tuple(p.shape) for name, p in params.items()}, where="state dict",
                 served=f"the {model.spec.family} model", shape_note=shard, error=WeightsError)
    out = {name: given[name] for name in params}
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


def load_weights(model: DecoderModel, weights: Mapping[str, torch.Tensor] | str | Path) -> None:
    """Validate all tensors (a state dict or an HF directory), then copy them in place.

    Under tensor parallelism every rank must call this with the same full tensors or directory: it keeps
    its shard of each (from a directory it reads only its shards), and the ranks agree before copying, so
    an update is taken by all ranks or refused by all.
    """
    tp = model.tensor_parallel
    if tp is None:
        if isinstance(weights, (str, Path)):
            weights = read_checkpoint(weights)
        copy_weights(model, validated_weights(model, weights))
        return
    tensors, error = {}, None
    try:
        if isinstance(weights, (str, Path)):
            shards = read_checkpoint(weights, tp.shard)
        else:
            shards = {k: tp.shard(k, v) if isinstance(v, torch.Tensor) else v for k, v in weights.items()}
        tensors = validated_weights(model, shards)
    except ValueError as exc:
        error = exc
    tp.agree(error, model.device)
    copy_weights(model, tensors)
