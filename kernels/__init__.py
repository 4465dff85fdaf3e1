"""Block-sparse attention: the reference semantics (`reference`), the CPU backend with fast gathers
(`TorchBackend`), the GPU kernels built against them (`triton`) and the factory that picks one.

The layout the kernels select under (`SparseAttentionConfig`) is defined in `sparrow.layout`."""

from sparrow.layout import SparseAttentionConfig

from .backend import AttentionBackend, ReferenceBackend
from .factory import BACKEND_NAMES, make_backend
from .torch_backend import TorchBackend

__all__ = ["BACKEND_NAMES", "AttentionBackend", "ReferenceBackend", "SparseAttentionConfig", "TorchBackend", "make_backend"]
