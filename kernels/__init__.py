"""Block-sparse attention: the reference semantics (`reference`) and the GPU kernels built against it."""

from .config import SparseAttentionConfig

__all__ = ["SparseAttentionConfig"]
