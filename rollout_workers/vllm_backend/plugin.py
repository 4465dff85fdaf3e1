"""The `vllm.general_plugins` entry point: vLLM calls `register()` in every process it starts.

Registration is by import path only, so the front end never imports model code (and on CUDA never
initialises the device before vLLM forks its workers).
"""

from . import _vllm
from .names import BACKEND_NAME, PACKAGE, SPARSE_ARCHITECTURES


def register() -> None:
    """Add the `SPARROW_SPARSE` attention backend and the Sparrow model classes (idempotent)."""
    enum = _vllm.AttentionBackendEnum
    if BACKEND_NAME not in enum.__members__:
        _vllm.register_backend(BACKEND_NAME, f"{PACKAGE}.backend.SparrowSparseBackend")
    registry = _vllm.ModelRegistry
    known = set(registry.get_supported_archs())
    for sparse_arch in SPARSE_ARCHITECTURES.values():
        if sparse_arch not in known:
            registry.register_model(sparse_arch, f"{PACKAGE}.models:{sparse_arch}")
