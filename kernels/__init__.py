"""Block-sparse attention: the reference semantics (`reference`) and the GPU kernels built against it."""

from .backend import AttentionBackend, ReferenceBackend
from .config import SparseAttentionConfig

__all__ = ["AttentionBackend", "ReferenceBackend", "SparseAttentionConfig"]
