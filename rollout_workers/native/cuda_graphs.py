"""CUDA-graph decode steps: the whole decode forward (embedding, KV writes, block-sparse attention, LM
head) captured once per (batch bucket, block-table width bucket, dense | sparse) and replayed.

Why: an eager decode step on a GPU is bound by the host — Python and ~30 kernel launches per layer
cost more than the GPU's work at rollout batch sizes. A replay issues the whole step at once.

What a replay reads, all at fixed addresses:
- `inputs [4, max_batch]` int64: token id, row slot, seq_len (context incl. the new token) and the
  block holding the new token, per row; one pinned host→device copy per step.
- `tables [max_rows + 1, max_blocks]` int32: every sequence's block table in its own row slot, written
  whole when its prefill completes (`write_table`). Decode-time block appends need no copy: the graph
  scatters each row's current block into its table before reading it. The last row is for padding.
- `budget_by_blocks [max_blocks + 1]`: the schedule as a lookup from a row's block count ceil(L/16)
  to its budget (blocks, sink and recent included), so budgets are computed on the device and a
  schedule hot-update is a buffer copy, never a recapture.

Padding rows (batch bucket > live rows) have seq_len 0 (the attention kernels write zeros), slot −1
(the KV write skips it) and the padding table row. The sampler runs after the replay, outside the
graph: it needs per-row seeds and host-side choices (`sampler.sample`), and costs a few launches.
On CPU the same body runs eagerly on the same buffers (no capture), which lets CPU tests check the
bookkeeping against the eager engine.
"""

import math

import torch

from sparrow.kernels import AttentionBackend, SparseAttentionConfig
from sparrow.schedule import DENSE_BUDGET, SparsitySchedule

from .attention import PagedDecode
from .kv_cache import KVCache
from .model import DecoderModel


def batch_buckets(max_rows: int) -> list[int]:
    """Batch sizes with a graph of their own: 1, 2, 4, then multiples of 8, and `max_rows` itself."""
    sizes = [b for b in (1, 2, 4) if b < max_rows] + list(range(8, max_rows, 8))
    return sizes + [max_rows]


def width_bucket(num_blocks: int, max_blocks: int) -> int:
    """Block-table width for a batch whose longest row has `num_blocks` blocks: the next power of two
    (≥ 16), so the scoring grid and the selection's register tile follow the context, not the maximum."""
    return min(max(16, 1 << max(0, num_blocks - 1).bit_length()), max_blocks)


class DecodeStep:
    """One captured (or, on CPU, eagerly run) decode step; `logits [batch, V]` and `blocks [batch]` are
    overwritten by every `replay`."""

    def __init__(self, batch: int, forward, graphs: bool, pool=None):
        self.batch = batch
        self._forward = forward
        self.graph = None
        if not graphs:
            self.logits, self.blocks = forward()
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up: Triton compiles, cuBLAS picks its kernels, outside the capture
            forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits, self.blocks = forward()

    def replay(self) -> None:
        if self.graph is None:
            self.logits, self.blocks = self._forward()
        else:
            self.graph.replay()


class DecodeGraphs:
    """Decode steps over a paged `KVCache` for up to `max_rows` sequences of up to `max_blocks` blocks."""

    def __init__(self, model: DecoderModel, cache: KVCache, backend: AttentionBackend, config: SparseAttentionConfig,
                 max_rows: int, max_blocks: int):
        self.model, self.cache, self.backend, self.config = model, cache, backend, config
        self.device = cache.k.device
        self.use_graphs = self.device.type == "cuda"
        self.max_rows, self.max_blocks, self.pad_row = max_rows, max_blocks, max_rows
        self.buckets = batch_buckets(max_rows)
        cap = self.buckets[-1]
        self.tables = torch.zeros(max_rows + 1, max_blocks, dtype=torch.int32, device=self.device)
        self.budget_by_blocks = torch.full((max_blocks + 1,), DENSE_BUDGET, dtype=torch.int32, device=self.device)
        self.inputs = torch.zeros(4, cap, dtype=torch.long, device=self.device)
        self._host = torch.zeros(4, cap, dtype=torch.long, pin_memory=self.use_graphs)
        self._copied = torch.cuda.Event() if self.use_graphs else None
        self._steps: dict[tuple[int, int, bool], DecodeStep] = {}
        self._pool = None
        spec = model.spec
        self.scale = spec.head_dim**-0.5
        prepare = getattr(backend, "prepare", None)
        if prepare is not None:  # graph capture must not allocate the attention scratch
            prepare(cap, max_blocks, spec.num_heads, spec.num_kv_heads, spec.head_dim, self.device)

    @property
    def num_captured(self) -> int:
        return len(self._steps)

    @property
    def captured(self) -> list[tuple[int, int, bool]]:
        """(batch, width, sparse) of every captured step: what a new set of graphs over a new cache recaptures."""
        return list(self._steps)

    def free(self) -> None:
        """Drop the steps and their memory pool now: each step's forward refers back to these graphs, a cycle that
        would keep the KV pool they read alive until Python's cycle collector happens to run."""
        self._steps.clear()
        self._pool = None

    def recapture(self, keys: list[tuple[int, int, bool]]) -> None:
        for key in keys:
            if key not in self._steps:
                self._capture(*key)

    def set_schedule(self, schedule: SparsitySchedule | None) -> None:
        """Refresh the device budget table (a copy; captured graphs stay valid)."""
        if schedule is None:
            self.budget_by_blocks.fill_(DENSE_BUDGET)
            return
        self.budget_by_blocks.copy_(schedule.budget_by_blocks(self.max_blocks).clamp(max=DENSE_BUDGET))

    def capture(self, batch_sizes, max_len: int, modes=(False, True)) -> None:
        """Capture now, instead of at first use, the steps for these batch sizes at every table width up to
        `max_len` tokens, in each mode (False = dense, True = sparse)."""
        top = min(math.ceil(max_len / self.config.block_size), self.max_blocks)
        widths, n = set(), 16
        while n < top:
            widths.add(width_bucket(n, self.max_blocks))
            n *= 2
        widths.add(width_bucket(top, self.max_blocks))
        for size in batch_sizes:
            batch = next(b for b in self.buckets if b >= min(size, self.max_rows))
            for width in sorted(widths):
                for sparse in modes:
                    if (batch, width, sparse) not in self._steps:
                        self._capture(batch, width, sparse)

    def write_table(self, row: int, blocks: list[int]) -> None:
        """Row slot `row` now holds a sequence whose block table is `blocks`."""
        if not 0 <= row < self.max_rows:
            raise ValueError(f"row slot {row}: use 0..{self.max_rows - 1}")
        if len(blocks) > self.max_blocks:
            raise ValueError(f"{len(blocks)} blocks exceed the {self.max_blocks} blocks per sequence the graphs hold")
        self.tables[row, : len(blocks)].copy_(torch.tensor(blocks, dtype=torch.int32))

    def stage(self, rows: list[int], token_ids: list[int] | None, seq_lens: list[int], current_blocks: list[int],
              sparse: bool, fed: torch.Tensor | None = None) -> DecodeStep:
        """Write one step's inputs (capturing its graph first if new); `replay()` then runs it. The token ids
        come from the host (`token_ids`) or, already on the device, from `fed` (a previous step's draws)."""
        n = len(rows)
        if not 0 < n <= self.max_rows:
            raise ValueError(f"{n} rows: a decode step takes 1..{self.max_rows}")
        batch = next(b for b in self.buckets if b >= n)
        width = width_bucket(math.ceil(max(seq_lens) / self.config.block_size), self.max_blocks)
        key = (batch, width, sparse)
        step = self._steps.get(key)
        if step is None:
            step = self._capture(*key)
        pad = batch - n
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the pinned buffer
        ids = [0] * n if token_ids is None else token_ids
        self._host[:, :batch] = torch.tensor(
            [ids + [0] * pad, rows + [self.pad_row] * pad, seq_lens + [0] * pad, current_blocks + [0] * pad]
        )
        self.inputs[:, :batch].copy_(self._host[:, :batch], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if fed is not None:  # after the host copy on the same stream, so it lands last
            self.inputs[0, :n].copy_(fed)
        return step

    def run(self, rows, token_ids, seq_lens, current_blocks, sparse: bool,
            fed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits `[n, V]` (valid until the next step) and blocks attended `[n]` (a copy) of one decode step."""
        step = self.stage(rows, token_ids, seq_lens, current_blocks, sparse, fed)
        step.replay()
        n = len(rows)
        return step.logits[:n], step.blocks[:n].clone()

    @torch.inference_mode()
    def _capture(self, batch: int, width: int, sparse: bool) -> DecodeStep:
        self.inputs[:, :batch] = torch.tensor([0, self.pad_row, 0, 0], device=self.device)[:, None]
        step = DecodeStep(batch, lambda: self._forward(batch, width, sparse), self.use_graphs, self._pool)
        if step.graph is not None and self._pool is None:
            self._pool = step.graph.pool()  # one memory pool for all graphs: they never run concurrently
        self._steps[(batch, width, sparse)] = step
        return step

    def _forward(self, batch: int, width: int, sparse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured body: device-side bookkeeping, then the model's decode forward and logits."""
        ids, rows, lens, current = self.inputs[:, :batch].unbind(0)
        bs = self.config.block_size
        pos = (lens - 1).clamp(min=0)
        self.tables.view(-1).scatter_(0, rows * self.max_blocks + pos // bs, current.to(torch.int32))
        slots = torch.where(lens > 0, current * bs + pos % bs, -1)
        tables = self.tables[:, :width].index_select(0, rows)
        num_blocks = (lens + bs - 1) // bs
        budgets = self.budget_by_blocks.index_select(0, num_blocks) if sparse else None
        attention = PagedDecode(self.cache, self.backend, self.config, slots, tables, lens, budgets, self.scale)
        logits = self.model.logits(self.model(ids, pos, attention))
        blocks = num_blocks if attention.blocks_attended is None else attention.blocks_attended
        return logits, blocks
