"""`TritonBackend`: the CUDA decode path (Triton kernels) behind the `AttentionBackend` contract.

Per sparse layer, `decode` launches four kernels — score, select, split-K attention, merge — whose
grids depend only on the batch size and the block-table width, and which read lengths, budgets and
block tables from device memory. Nothing synchronizes with the host, so an engine can capture one
CUDA graph per batch-size bucket and replay it while lengths and budgets change every step.

What the engine must do for graph capture:
- call `prepare(max_batch, max_blocks_per_seq, num_q_heads, num_kv_heads, head_dim, device)` once
  before capturing (it allocates the scratch buffers shared by all layers: scores and selected ids
  `[max_batch·H_kv, max_blocks_per_seq]`, split-K partials); `decode` refuses to grow them while a
  graph is being captured;
- keep `q`, the caches, `block_tables [B, max_blocks_per_seq]`, `seq_lens [B]` and `budgets [B]` at
  fixed addresses and update them in place between replays; the captured graph's outputs are the
  tensors returned by the captured `decode` call;
- pad the batch with rows of `seq_len = 0` (they produce zeros) and `write_kv` with slots of −1
  (skipped). One graph per batch size: the split-K factor is chosen from the batch size alone.
"""

from dataclasses import dataclass

import torch
import triton

from sparrow.layout import SparseAttentionConfig

from ..backend import AttentionBackend
from ..reference import check_landmark_dtype
from .attention import AttentionTiling, cache_strides, decode_attention
from .kv_write import write_kv as triton_write_kv
from .scoring import score_blocks
from .selection import select_blocks

MAX_SPLITS = 16


SPLIT_WAVES = 4  # best of {2, 4, 8, 16} in the H200 sweep (docs/performance.md)
SPLIT_WAVES_FP8 = 2  # FP8 pages: best of {2, 4, 8} in the H200 sweep of their tiling (docs/performance.md)
RESIDENT_PROGRAMS = 4  # attention programs one SM holds at once: bfloat16 tiling, 122 registers per thread (sm_90)
RESIDENT_PROGRAMS_FP8 = 2  # FP8 tiling: 182-255 registers per thread


def split_waves(fp8: bool) -> int:
    """The split-K minimum, in programs per SM, for bfloat16 or FP8 pages."""
    return SPLIT_WAVES_FP8 if fp8 else SPLIT_WAVES


def choose_splits(rows: int, num_sms: int, fp8: bool = False, waves: int | None = None) -> int:
    """Split-K factor (power of two ≤ MAX_SPLITS). At least `waves` programs per SM (default `split_waves`), so
    enough loads are in flight; then the count among those left whose last wave is fullest: programs run
    `RESIDENT_PROGRAMS` per SM at a time and each does 1/splits of a row, so a call takes about
    ceil(rows·splits / (resident·SMs)) / splits rows' worth of time (ties: fewer splits, less to merge). Without
    that step a nearly empty last wave costs as much as a full one: FP8 pages at batch 40 (320 rows, 1.2 waves of
    one split) took 1605 µs per 32K layer against 1157 µs with 4 splits (H200 sweep, docs/performance.md)."""
    waves = waves or split_waves(fp8)
    slots = (RESIDENT_PROGRAMS_FP8 if fp8 else RESIDENT_PROGRAMS) * num_sms
    splits = 1
    while rows * splits < waves * num_sms and splits < MAX_SPLITS:
        splits *= 2
    candidates = [splits << k for k in range(MAX_SPLITS.bit_length()) if splits << k <= MAX_SPLITS]
    return min(candidates, key=lambda s: (-(-rows * s // slots) / s, s))


@dataclass
class DecodeWorkspace:
    """Scratch shared by all layers (they run one after another on one stream)."""

    max_batch: int
    max_blocks: int
    num_kv_heads: int
    group: int
    head_dim: int
    scores: torch.Tensor  # [max_batch·H_kv, max_blocks] float32
    selected: torch.Tensor  # [max_batch·H_kv, max_blocks] int32 physical ids
    o_part: torch.Tensor  # flat float32, ≥ rows·splits·G·D for every batch size ≤ max_batch
    lse_part: torch.Tensor  # flat float32, ≥ rows·splits·G

    def fits(self, batch: int, max_blocks: int, num_kv_heads: int, group: int, head_dim: int, device) -> bool:
        return (
            batch <= self.max_batch and max_blocks <= self.max_blocks and self.scores.device == torch.device(device)
            and (num_kv_heads, group, head_dim) == (self.num_kv_heads, self.group, self.head_dim)
        )


class TritonBackend(AttentionBackend):
    """Block-sparse and dense paged decode with Triton kernels (CUDA; CPU tensors under TRITON_INTERPRET=1)."""

    name = "triton"

    def __init__(self, splits: int | None = None, tiling: AttentionTiling | None = None):
        if splits is not None and not (1 <= splits <= MAX_SPLITS):
            raise ValueError(f"splits={splits}: use 1..{MAX_SPLITS} or None (chosen from the batch size)")
        self.fixed_splits = splits
        self.tiling = tiling
        self.workspace: DecodeWorkspace | None = None
        self._num_sms: dict[torch.device, int] = {}

    def num_sms(self, device: torch.device) -> int:
        if device not in self._num_sms:
            is_cuda = device.type == "cuda"
            self._num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count if is_cuda else 2
        return self._num_sms[device]

    def splits_for(self, batch: int, num_kv_heads: int, device, fp8: bool = False) -> int:
        """Splits of one decode call (the workspace holds the partials of either page format's count)."""
        if self.fixed_splits is not None:
            return self.fixed_splits
        return choose_splits(batch * num_kv_heads, self.num_sms(torch.device(device)), fp8)

    def prepare(self, max_batch: int, max_blocks_per_seq: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                device) -> DecodeWorkspace:
        """Allocate the decode scratch for batches up to `max_batch` and block tables up to `max_blocks_per_seq` wide."""
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        device = torch.device(device)
        group = num_q_heads // num_kv_heads
        rows = max_batch * num_kv_heads
        parts = max(b * num_kv_heads * self.splits_for(b, num_kv_heads, device, fp8)
                    for b in range(1, max_batch + 1) for fp8 in (False, True))
        self.workspace = DecodeWorkspace(
            max_batch=max_batch, max_blocks=max_blocks_per_seq, num_kv_heads=num_kv_heads, group=group,
            head_dim=head_dim,
            scores=torch.empty(rows, max_blocks_per_seq, dtype=torch.float32, device=device),
            selected=torch.empty(rows, max_blocks_per_seq, dtype=torch.int32, device=device),
            o_part=torch.empty(parts * group * head_dim, dtype=torch.float32, device=device),
            lse_part=torch.empty(parts * group, dtype=torch.float32, device=device),
        )
        return self.workspace

    def _workspace(self, batch, max_blocks, num_q_heads, num_kv_heads, head_dim, device) -> DecodeWorkspace:
        group = num_q_heads // num_kv_heads
        ws = self.workspace
        if ws is not None and ws.fits(batch, max_blocks, num_kv_heads, group, head_dim, device):
            return ws
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"TritonBackend: no workspace for batch {batch} x {max_blocks} blocks (H_q={num_q_heads}, "
                f"H_kv={num_kv_heads}, D={head_dim}) during CUDA-graph capture; call "
                "prepare(max_batch, max_blocks_per_seq, num_q_heads, num_kv_heads, head_dim, device) before capturing"
            )
        grow_batch = max(batch, ws.max_batch if ws else 0)
        grow_blocks = max(max_blocks, ws.max_blocks if ws else 0)
        return self.prepare(grow_batch, grow_blocks, num_q_heads, num_kv_heads, head_dim, device)

    def write_kv(self, k_cache, v_cache, landmarks, slots, k, v, config: SparseAttentionConfig, kv_scales=None) -> None:
        _check_block_size(k_cache, config)
        triton_write_kv(k_cache, v_cache, landmarks, slots, k, v, config.landmark, kv_scales)

    def decode(self, q, k_cache, v_cache, landmarks, block_tables, seq_lens, budgets, config: SparseAttentionConfig,
               scale, kv_scales=None):
        _check_block_size(k_cache, config)
        _check_decode_inputs(q, k_cache, v_cache, landmarks, block_tables, seq_lens, budgets, config)
        bsz, num_q_heads, head_dim = q.shape
        num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
        out = torch.empty(bsz, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
        if bsz == 0:
            return out, torch.zeros(0, dtype=torch.long, device=q.device)
        max_blocks = block_tables.shape[1]
        ws = self._workspace(bsz, max_blocks, num_q_heads, num_kv_heads, head_dim, q.device)
        splits = self.splits_for(bsz, num_kv_heads, q.device, fp8=kv_scales is not None)
        common = dict(scale=float(scale), splits=splits, tiling=self.tiling, kv_scales=kv_scales)
        counts = torch.empty(bsz, dtype=torch.long, device=q.device)
        if budgets is None:
            decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out, ws.o_part, ws.lse_part, counts=counts,
                             **common)
            return out, counts
        score_blocks(q, landmarks, block_tables, seq_lens, budgets, ws.scores, block_size=block_size,
                     sink=config.sink, recent=config.recent, mode=config.landmark)
        select_blocks(ws.scores, block_tables, seq_lens, budgets, ws.selected, counts, num_kv_heads=num_kv_heads,
                      block_size=block_size, sink=config.sink, recent=config.recent)
        decode_attention(q, k_cache, v_cache, block_tables, seq_lens, out, ws.o_part, ws.lse_part, budgets=budgets,
                         selected=ws.selected, sink=config.sink, recent=config.recent, **common)
        return out, counts


def _check_block_size(k_cache: torch.Tensor, config: SparseAttentionConfig) -> None:
    if k_cache.shape[2] != config.block_size:
        raise ValueError(f"cache block size {k_cache.shape[2]} != config.block_size={config.block_size}")


def _check_decode_inputs(q, k_cache, v_cache, landmarks, block_tables, seq_lens, budgets, config) -> None:
    """Shape/layout checks only: values stay on the device (no synchronization)."""
    bsz, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q has {num_q_heads} heads, not a multiple of the cache's {num_kv_heads} KV heads")
    if k_cache.shape[3] != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q head_dim {head_dim} vs caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    cache_strides(k_cache, v_cache)
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous last (head_dim) dimension")
    if block_tables.dim() != 2 or block_tables.shape[0] != bsz or block_tables.stride(1) != 1:
        raise ValueError(f"block_tables {tuple(block_tables.shape)}: expected [B={bsz}, M] with contiguous rows")
    if seq_lens.shape != (bsz,):
        raise ValueError(f"seq_lens {tuple(seq_lens.shape)}: expected [{bsz}]")
    if budgets is None:
        return
    if budgets.shape != (bsz,):
        raise ValueError(f"budgets {tuple(budgets.shape)}: expected [{bsz}]")
    if landmarks is None:
        raise ValueError("sparse decode (budgets given) needs the landmarks tensor")
    width = config.landmark_width(head_dim)
    if landmarks.shape != (k_cache.shape[0], num_kv_heads, width) or not landmarks.is_contiguous():
        raise ValueError(
            f"landmarks {tuple(landmarks.shape)}: expected contiguous [{k_cache.shape[0]}, {num_kv_heads}, {width}] "
            f"for landmark={config.landmark!r}"
        )
    check_landmark_dtype(landmarks, config.landmark)
    if triton.next_power_of_2(k_cache.shape[2]) != k_cache.shape[2]:
        raise ValueError(f"block_size={k_cache.shape[2]}: the Triton kernels need a power of two")
