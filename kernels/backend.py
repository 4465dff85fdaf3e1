"""The pluggable attention backend a rollout engine drives: KV writes with landmarks, and decode.

The engine owns the cache tensors and the prefill path; a backend only implements the two
operations whose speed decides rollout throughput. `ReferenceBackend` is the CPU default and the
semantics every other backend (Triton on CUDA) must match.
"""

from abc import ABC, abstractmethod

import torch

from sparrow.layout import SparseAttentionConfig

from .reference import KVScales, block_sparse_decode, paged_decode_attention, write_kv


class AttentionBackend(ABC):
    name: str

    @abstractmethod
    def write_kv(self, k_cache, v_cache, landmarks, slots, k, v, config: SparseAttentionConfig,
                 kv_scales: KVScales | None = None) -> None:
        """Store `k, v: [T, H_kv, D]` at `slots: [T]`; maintain landmarks (None for dense layers). `kv_scales`: the
        caches are FP8 pages (`sparrow.kernels.reference.kv_quant`), quantized as written."""

    @abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        landmarks: torch.Tensor | None,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        budgets: torch.Tensor | None,
        config: SparseAttentionConfig,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One query per sequence. `budgets=None` means dense (dense layers, dense rollouts); `kv_scales`: FP8 pages.
        Returns the output `[B, H_q, D]` and the blocks attended per sequence `[B]`."""


class ReferenceBackend(AttentionBackend):
    name = "reference"

    def write_kv(self, k_cache, v_cache, landmarks, slots, k, v, config, kv_scales=None):
        write_kv(k_cache, v_cache, landmarks, slots, k, v, config.landmark, kv_scales)

    def decode(self, q, k_cache, v_cache, landmarks, block_tables, seq_lens, budgets, config, scale, kv_scales=None):
        if budgets is None:
            out = paged_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale, kv_scales=kv_scales)
            return out, (seq_lens.long() + k_cache.shape[2] - 1) // k_cache.shape[2]
        return block_sparse_decode(q, k_cache, v_cache, landmarks, block_tables, seq_lens, budgets, config, scale,
                                   kv_scales)
