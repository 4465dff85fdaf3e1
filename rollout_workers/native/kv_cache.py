"""The paged KV cache: per layer `[num_blocks, H_kv, 16, D]` keys and values (HND pages), plus one
landmark per (block, KV head) in the sparse layers only — dense layers never score blocks.

With `kv_cache_dtype="fp8_e4m3"` the pages hold e4m3 values with one float32 scale per stored vector
(`sparrow.kernels.reference.kv_quant`); landmarks stay in the model's dtype, or int8 rows with their scale for
`landmark: mean_int8` (`sparrow.kernels.reference.landmarks`)."""

import torch

from sparrow.kernels import SparseAttentionConfig
from sparrow.kernels.reference import FP8_KV_DTYPE, KVScales, landmark_dtype, page_dtype, vector_bytes

from .model_spec import ModelSpec
from .transfer import to_device


def bytes_per_block(spec: ModelSpec, attention: SparseAttentionConfig, dtype: torch.dtype,
                    kv_cache_dtype: str = "auto") -> int:
    """Bytes of one block in every layer: K/V pages (and FP8 scales), plus the sparse layers' landmarks."""
    vectors = 2 * spec.num_layers * spec.num_kv_heads * attention.block_size
    sparse_layers = sum(1 for i in range(spec.num_layers) if not attention.is_dense_layer(i))
    landmarks = sparse_layers * spec.num_kv_heads * attention.landmark_bytes(spec.head_dim, dtype.itemsize)
    return vectors * vector_bytes(spec.head_dim, dtype, kv_cache_dtype) + landmarks


class KVCache:
    def __init__(self, spec: ModelSpec, attention: SparseAttentionConfig, num_blocks: int, dtype, device,
                 kv_cache_dtype: str = "auto"):
        shape = (spec.num_layers, num_blocks, spec.num_kv_heads, attention.block_size, spec.head_dim)
        # Left uninitialised so a large CPU pool costs nothing until used; blocks are zeroed when
        # allocated (`zero_blocks`): unwritten slots are masked out of softmax, but 0 · NaN would not be.
        pages = page_dtype(kv_cache_dtype, dtype)
        self.kv_cache_dtype = kv_cache_dtype
        self.k = torch.empty(shape, dtype=pages, device=device)
        self.v = torch.empty(shape, dtype=pages, device=device)
        self.k_scale = self.v_scale = None
        if kv_cache_dtype != "auto":
            self.k_scale = torch.empty(shape[:-1], dtype=torch.float32, device=device)
            self.v_scale = torch.empty(shape[:-1], dtype=torch.float32, device=device)
        self.sparse_layers = [i for i in range(spec.num_layers) if not attention.is_dense_layer(i)]
        self._landmark_index = {layer: j for j, layer in enumerate(self.sparse_layers)}
        width = attention.landmark_width(spec.head_dim)
        self.landmarks = torch.empty(
            (len(self.sparse_layers), num_blocks, spec.num_kv_heads, width), dtype=landmark_dtype(attention.landmark, dtype),
            device=device,
        )
        self.num_blocks = num_blocks
        self.block_size = attention.block_size

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        j = self._landmark_index.get(i)
        return self.k[i], self.v[i], None if j is None else self.landmarks[j]

    def scales(self, i: int) -> KVScales | None:
        """Layer i's FP8 scales (None: pages in the model's dtype)."""
        return None if self.k_scale is None else KVScales(self.k_scale[i], self.v_scale[i])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors)

    @property
    def _tensors(self) -> list[torch.Tensor]:
        scales = [] if self.k_scale is None else [self.k_scale, self.v_scale]
        return [self.k, self.v, self.landmarks, *scales]

    def zero_blocks(self, blocks: list[int]) -> None:
        index = to_device(blocks, self.k.device)
        for t in self._tensors:
            if t.dtype == FP8_KV_DTYPE:  # index_fill_ has no float8 kernel; the bytes of +0.0 are 0
                t.view(torch.uint8).index_fill_(1, index, 0)
            else:
                t.index_fill_(1, index, 0)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks (all layers) — the copy-on-fork of a partial prompt block."""
        s = torch.tensor(src, device=self.k.device)
        d = torch.tensor(dst, device=self.k.device)
        for t in self._tensors:
            t[:, d] = t[:, s]
