"""`make_backend`: the one place an `AttentionBackend` is chosen by name for a device."""

import torch

from .backend import AttentionBackend, ReferenceBackend
from .torch_backend import TorchBackend

BACKEND_NAMES = ("auto", "torch", "reference", "triton")


def make_backend(name: str, device: torch.device) -> AttentionBackend:
    """`auto` = `triton` on CUDA when the Triton kernels import, else `torch`; `triton` is imported only
    when chosen, and a failed import is an error only when it was asked for by name."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend={name!r}: use one of {BACKEND_NAMES}")
    if name == "reference":
        return ReferenceBackend()
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchBackend()
    try:
        from .triton import TritonBackend
    except ImportError as exc:
        if name == "triton":
            raise ValueError(f"attention_backend='triton': cannot import the Triton kernels ({exc})") from None
        return TorchBackend()
    return TritonBackend()
