"""The paged KV cache: per layer `[num_blocks, H_kv, 16, D]` keys and values (HND pages), plus one
landmark per (block, KV head) in the sparse layers only — dense layers never score blocks."""

import torch

from sparrow.kernels import SparseAttentionConfig

from .model_spec import ModelSpec
from .transfer import to_device


def bytes_per_block(spec: ModelSpec, attention: SparseAttentionConfig, dtype: torch.dtype) -> int:
    size = torch.empty((), dtype=dtype).element_size()
    kv = 2 * spec.num_layers * spec.num_kv_heads * attention.block_size * spec.head_dim
    sparse_layers = sum(1 for i in range(spec.num_layers) if not attention.is_dense_layer(i))
    landmarks = sparse_layers * spec.num_kv_heads * attention.landmark_width(spec.head_dim)
    return (kv + landmarks) * size


class KVCache:
    def __init__(self, spec: ModelSpec, attention: SparseAttentionConfig, num_blocks: int, dtype, device):
        shape = (spec.num_layers, num_blocks, spec.num_kv_heads, attention.block_size, spec.head_dim)
        # Left uninitialised so a large CPU pool costs nothing until used; blocks are zeroed when
        # allocated (`zero_blocks`): unwritten slots are masked out of softmax, but 0 · NaN would not be.
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.sparse_layers = [i for i in range(spec.num_layers) if not attention.is_dense_layer(i)]
        self._landmark_index = {layer: j for j, layer in enumerate(self.sparse_layers)}
        width = attention.landmark_width(spec.head_dim)
        self.landmarks = torch.empty(
            (len(self.sparse_layers), num_blocks, spec.num_kv_heads, width), dtype=dtype, device=device
        )
        self.num_blocks = num_blocks
        self.block_size = attention.block_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        j = self._landmark_index.get(i)
        return self.k[i], self.v[i], None if j is None else self.landmarks[j]

    def zero_blocks(self, blocks: list[int]) -> None:
        index = to_device(blocks, self.k.device)
        for t in (self.k, self.v, self.landmarks):
            t.index_fill_(1, index, 0)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks (all layers) — the copy-on-fork of a partial prompt block."""
        s = torch.tensor(src, device=self.k.device)
        d = torch.tensor(dst, device=self.k.device)
        self.k[:, d] = self.k[:, s]
        self.v[:, d] = self.v[:, s]
        self.landmarks[:, d] = self.landmarks[:, s]
