"""Triton kernels for block-sparse paged decode (CUDA; CPU under TRITON_INTERPRET=1 for tests).

`TritonBackend` is the engine-facing entry point; the launchers below are exposed for tests and the
kernel benchmark (`sparrow bench kernels`).
"""

from .attention import AttentionTiling, attention_partials, attention_tiling, decode_attention, merge_splits
from .backend import DecodeWorkspace, TritonBackend, choose_splits
from .kv_write import write_kv
from .scoring import score_blocks
from .selection import select_blocks

__all__ = [
    "AttentionTiling",
    "DecodeWorkspace",
    "TritonBackend",
    "attention_partials",
    "attention_tiling",
    "choose_splits",
    "decode_attention",
    "merge_splits",
    "score_blocks",
    "select_blocks",
    "write_kv",
]
