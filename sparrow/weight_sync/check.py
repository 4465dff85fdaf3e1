"""An update checked whole against the model an engine serves, before any of it is loaded.

Engines copy (native) or reload (vLLM) tensor by tensor, so a bad tensor found midway would leave them serving a mix of
two policies; both call `check_update` first and keep their old weights when it raises. A tensor is checked by its
values, a checkpoint on disk by its safetensors headers (names, shapes, dtypes; its values are vLLM's to read).
"""

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open

from sparrow.finite import first_nonfinite

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLOAT_HEADER_DTYPES = ("F32", "BF16", "F16")  # the same three, as safetensors headers name them


class TensorHeader(NamedTuple):
    """A tensor of a safetensors file as its header describes it."""

    shape: tuple[int, ...]
    dtype: str


def read_headers(files: Iterable[Path]) -> dict[str, TensorHeader]:
    """Name → header of every tensor in the files, reading no tensor data."""
    headers = {}
    for f in files:
        with safe_open(str(f), "pt") as handle:
            for name in handle.keys():
                part = handle.get_slice(name)
                headers[name] = TensorHeader(tuple(part.get_shape()), part.get_dtype())
    return headers


def _names(keys: Iterable[str], limit: int = 8) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def check_update(given: Mapping[str, object], expected: Mapping[str, tuple[int, ...]], *, where: str, served: str,
                 optional: Iterable[str] = (), shape_note: str = "", error: type[ValueError] = ValueError) -> None:
    """Raise `error` naming the tensor unless `given` (name → tensor or `TensorHeader`) has exactly `expected`'s names
    (those in `optional` may come or not and are not checked here), its shapes, a floating dtype and, for tensors,
    only finite values. `where` names what was sent ("state dict", "checkpoint DIR"), `served` the model it must fit."""
    optional = set(optional)
    names = given.keys() - optional
    missing, unexpected = expected.keys() - optional - names, names - expected.keys()
    if missing or unexpected:
        parts = ([f"missing keys: {_names(missing)}"] if missing else []) + (
            [f"unexpected keys: {_names(unexpected)}"] if unexpected else [])
        raise error(f"the {where} does not match {served}: " + "; ".join(parts))
    tensors = {}
    for name in sorted(names):
        item = given[name]
        if isinstance(item, torch.Tensor):
            dtype, floating = item.dtype, item.dtype in FLOAT_DTYPES
            tensors[name] = item
        elif isinstance(item, TensorHeader):
            dtype, floating = item.dtype, item.dtype in FLOAT_HEADER_DTYPES
        else:
            raise error(f"{name}: expected a tensor, got {type(item).__name__}")
        if not floating:
            raise error(f"{name}: dtype {dtype} in the {where} is not a floating weight type; "
                        "send float32, bfloat16 or float16")
        if tuple(item.shape) != tuple(expected[name]):
            raise error(f"{name}: shape {tuple(item.shape)} in the {where}, the served model's is "
                        f"{tuple(expected[name])}{shape_note}")
    if (bad := first_nonfinite(tensors)) is not None:
        raise error(f"{bad}: contains NaN or inf values; the engine keeps the weights it serves")
