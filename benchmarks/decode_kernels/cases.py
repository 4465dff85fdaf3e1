"""The synthetic decode cases the kernel benchmark times: one random paged K/V pool with landmarks, batches of
sequences over random blocks of it, and the bytes each kernel must move for a case (the achieved-bandwidth
numerator)."""

import math
from dataclasses import dataclass

import torch

from sparrow.bench.cuda_timing import DEVICE
from sparrow.kernels.reference import KVScales, quantize, vector_bytes
from sparrow.layout import BLOCK_SIZE, KVCacheDType, SparseAttentionConfig


class Pool:
    """One paged K/V pool with landmarks (both widths), shared by all cases; block tables are random
    permutations of its blocks, as in a long-running engine. FP8 pages hold the e4m3 values and scales of the
    same random normals."""

    def __init__(self, num_blocks: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: KVCacheDType = "auto"):
        shape = (num_blocks, num_kv_heads, BLOCK_SIZE, head_dim)
        self.k = torch.empty(shape, dtype=torch.bfloat16, device=DEVICE).normal_()
        self.v = torch.empty(shape, dtype=torch.bfloat16, device=DEVICE).normal_()
        self.scales: KVScales | None = None
        if kv_cache_dtype != "auto":
            (self.k, k_scale), (self.v, v_scale) = quantize(self.k), quantize(self.v)
            self.scales = KVScales(k_scale, v_scale)
        self.vector_bytes = vector_bytes(head_dim, torch.bfloat16, kv_cache_dtype)
        self.mean = torch.empty(num_blocks, num_kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE).normal_()
        mid = torch.empty(num_blocks, num_kv_heads, head_dim, dtype=torch.bfloat16, device=DEVICE).normal_()
        spread = torch.rand_like(mid) * 2
        self.minmax = torch.cat([mid + spread, mid - spread], dim=-1).contiguous()
        self.num_blocks = num_blocks


@dataclass
class Case:
    batch: int
    context: int
    group: int
    seq_lens: torch.Tensor
    tables: torch.Tensor
    q: torch.Tensor

    @property
    def lengths(self) -> list[int]:
        return self.seq_lens.tolist()


def make_case(pool: Pool, batch: int, context: int, group: int, num_kv_heads: int, head_dim: int, seed: int) -> Case:
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    lengths = [context - (7 * b) % BLOCK_SIZE for b in range(batch)]  # mixed partial blocks, about `context` tokens
    width = math.ceil(context / BLOCK_SIZE)
    perm = torch.randperm(pool.num_blocks, device=DEVICE, generator=gen)[: batch * width]
    q = torch.randn(batch, num_kv_heads * group, head_dim, device=DEVICE, generator=gen).to(torch.bfloat16)
    return Case(batch, context, group, torch.tensor(lengths, dtype=torch.int32, device=DEVICE),
                perm.view(batch, width).int().contiguous(), q)


def dense_bytes(case: Case, num_kv_heads: int, vec_bytes: int) -> int:
    return sum(case.lengths) * num_kv_heads * 2 * vec_bytes


def sparse_bytes(case: Case, budget_blocks: int, config: SparseAttentionConfig, num_kv_heads: int,
                 head_dim: int, vec_bytes: int) -> dict[str, int]:
    kv = scan = scores = 0
    for length in case.lengths:
        n = math.ceil(length / BLOCK_SIZE)
        budget = max(budget_blocks, config.reserved_blocks)
        if n <= budget:
            kv += length
            continue
        kv += (budget - 1) * BLOCK_SIZE + length - (n - 1) * BLOCK_SIZE
        candidates = n - config.reserved_blocks
        scan += candidates * config.landmark_bytes(head_dim, 2)
        scores += candidates * 4 * 2
    kv *= num_kv_heads * 2 * vec_bytes
    return {"kv": kv, "landmarks": scan * num_kv_heads, "scores": scores * num_kv_heads,
            "total": kv + (scan + scores) * num_kv_heads}
