"""Block-sparse attention: the reference semantics (`reference`) and the GPU kernels built against it.

The layout the kernels select under (`SparseAttentionConfig`) is defined in `sparrow.layout`."""

from sparrow.layout import SparseAttentionConfig

from .backend import AttentionBackend, ReferenceBackend

__all__ = ["AttentionBackend", "ReferenceBackend", "SparseAttentionConfig"]
