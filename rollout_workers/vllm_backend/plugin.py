"""The `vllm.general_plugins` entry point: vLLM calls `register()` in every process it starts.

Registration is by import path only, so the front end never imports model code (and on CUDA never
initialises the device before vLLM forks its workers).
"""

import logging

from . import _vllm
from .names import PACKAGE, SPARSE_ARCHITECTURES


def register() -> None:
    """Add the sparse attention backend (`SPARROW_SPARSE`, or `CUSTOM` before vLLM 0.32) and the Sparrow model
    classes (idempotent).

    On a vLLM release outside the supported range it registers nothing and says why: vLLM calls every installed
    plugin unguarded, so raising here would stop plain vLLM too; `VllmEngine` raises the same reason.
    """
    version = _vllm.vllm_version()
    if not _vllm.is_supported(version):
        logging.getLogger(__name__).warning(
            "Sparrow's vLLM plugin is not registered: vLLM %s is installed, it supports vllm %s", version,
            _vllm.SUPPORTED_RANGE,
        )
        return
    name, enum = _vllm.surface().backend_name, _vllm.AttentionBackendEnum
    _vllm.register_backend(enum[name] if name in enum.__members__ else name, f"{PACKAGE}.backend.SparrowSparseBackend")
    registry = _vllm.ModelRegistry
    known = set(registry.get_supported_archs())
    for sparse_arch in SPARSE_ARCHITECTURES.values():
        if sparse_arch not in known:
            registry.register_model(sparse_arch, f"{PACKAGE}.models:{sparse_arch}")
