"""`ModelRunner`: everything of the native engine that lives on the device.

It builds (or takes) the model, sizes and owns the KV pool, zeroes blocks before their first use,
picks the attention backend, keeps the decode graphs and their row slots, turns scheduled sequences
into the tensors of a prefill or decode forward, runs it and draws the next tokens. It decides nothing
about which sequences run: that is the scheduler's job; the engine loop hands it their sequences.
"""

import os

import torch
from torch import distributed as dist

from sparrow.kernels import make_backend
from sparrow.schedule import DENSE_BUDGET, SparsitySchedule

from .attention import PagedDecode, PagedPrefill, PrefillChunkMeta, blocks_attended
from .config import NativeEngineConfig
from .cuda_graphs import DecodeGraphs
from .kv_cache import KVCache, bytes_per_block
from .model import DecoderModel
from .model_loader import load_model, resolve_device, resolve_dtype
from .sampler import SamplingBatch, sample, uses_fused_sampler
from .scheduler import PrefillChunk
from .sequence import Draws, PendingDraws, Sequence
from .weights import load_weights


def free_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.empty_cache()  # cached but unused blocks (e.g. the weights a fused model replaced) are free too
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class ModelRunner:
    def __init__(self, config: NativeEngineConfig, model: DecoderModel | None = None,
                 process_group: dist.ProcessGroup | None = None):
        self.config = config
        self.device = resolve_device(config.device)
        if model is None:
            if config.model is None:
                raise ValueError("NativeEngineConfig.model is not set: give an HF model directory (config.json + safetensors)")
            model = load_model(config.model, self.device, resolve_dtype(config.dtype, self.device), config.max_model_len,
                               config.tensor_parallel_size, process_group)
        self.tensor_parallel = model.tensor_parallel
        tp_size = 1 if self.tensor_parallel is None else self.tensor_parallel.size
        if tp_size != config.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size}, but the model given was built "
                             f"for {tp_size} ranks; build it with a TensorParallel of the same size")
        self.model = model
        self.spec = model.spec
        self.all_reduce = None if self.tensor_parallel is None else self.tensor_parallel.use_symmetric_memory(
            config.max_num_seqs * self.spec.hidden_size, model.dtype, self.device, config.symmetric_memory_all_reduce)
        self.max_model_len = min(config.max_model_len or self.spec.max_position_embeddings, model.rope.cos.shape[0])
        self.layout = config.layout()
        self.layout.check_layers(self.spec.num_layers)
        self.backend = make_backend(config.attention_backend, self.device)
        fp8_on_cuda = config.kv_cache_dtype != "auto" and self.device.type == "cuda"
        if fp8_on_cuda and torch.cuda.get_device_capability(self.device) < (8, 9):
            raise ValueError(
                f"kv_cache_dtype={config.kv_cache_dtype!r}: e4m3 needs a GPU of compute capability 8.9 or newer (Ada, "
                f"Hopper); this one is {torch.cuda.get_device_capability(self.device)}. Use kv_cache_dtype='auto'"
            )
        self.num_kv_blocks = self._num_kv_blocks()
        self.cache = self._new_cache()
        self._schedule: SparsitySchedule | None = None
        self._recapture: list[tuple[int, int, bool]] = []
        """Decode graphs to capture again when the released memory comes back."""
        self._unzeroed: list[int] = []
        """Blocks allocated since the last forward; zeroed together, once, before it (`_zero_new_blocks`)."""
        self.graphs = self._decode_graphs()
        self._rows: dict[Sequence, int] = {}
        """Row slot of each decoding sequence in the decode graphs' block-table buffer."""
        self._free_rows = list(range(config.max_num_seqs))[::-1]
        self._budget_table: list[int] | None = None
        """Budget (blocks) by a context's block count under the schedule in force, for O(1) lookups per row."""

    # ------------------------------------------------------------------ set-up

    def _new_cache(self) -> KVCache:
        try:
            return KVCache(self.spec, self.layout, self.num_kv_blocks, self.model.dtype, self.device,
                           self.config.kv_cache_dtype)
        except torch.OutOfMemoryError:
            need = self.num_kv_blocks * bytes_per_block(self.spec, self.layout, self.model.dtype, self.config.kv_cache_dtype)
            raise MemoryError(
                f"num_kv_blocks={self.num_kv_blocks}: the KV pool needs {need / 2**30:.1f} GiB, more than {self.device} "
                f"has free ({free_memory_bytes(self.device) / 2**30:.1f} GiB); lower num_kv_blocks (or max_num_seqs), "
                "leave it unset to take kv_memory_fraction of the free memory, or halve the pages with "
                "kv_cache_dtype='fp8_e4m3'"
            ) from None

    def release_memory(self) -> int:
        """Free the KV pool and the decode graphs with their memory pool (the engine is idle: no sequence holds a
        block or a row); returns the bytes of the pool freed. `restore_memory` brings both back."""
        freed = self.cache.nbytes
        self._recapture = []
        if self.graphs is not None:
            self._recapture = self.graphs.captured
            self.graphs.free()
        self.cache = self.graphs = None
        self._unzeroed.clear()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
        return freed

    def restore_memory(self) -> int:
        """A new KV pool of the same size, and new decode graphs over it: the graphs captured before the release
        are captured again now (their addresses changed), so no capture falls into the next rollouts."""
        self.cache = self._new_cache()
        self.graphs = self._decode_graphs()
        self.set_schedule(self._schedule)
        if self.graphs is not None:
            self.graphs.recapture(self._recapture)
        return self.cache.nbytes

    def _num_kv_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        per_block = bytes_per_block(self.spec, self.layout, self.model.dtype, self.config.kv_cache_dtype)
        ceiling = self.config.max_num_seqs * self.layout.blocks_for(self.max_model_len)
        budget = int(self.config.kv_memory_fraction * free_memory_bytes(self.device)) // per_block
        if self.tensor_parallel is not None:  # every rank must run the same pool, or their schedulers diverge
            budget = self.tensor_parallel.smallest(budget, self.device)
        if budget < 1:
            raise ValueError(
                f"kv_memory_fraction={self.config.kv_memory_fraction} leaves no room for one KV block "
                f"({per_block} bytes); raise it or set num_kv_blocks"
            )
        return min(ceiling, budget)

    def _decode_graphs(self) -> DecodeGraphs | None:
        graph_safe = self.device.type == "cuda" and self.backend.name == "triton"
        wanted = graph_safe if self.config.cuda_graphs is None else self.config.cuda_graphs
        if wanted and not graph_safe:
            raise ValueError(
                f"cuda_graphs=True needs device='cuda' and the triton attention backend (here device="
                f"{self.config.device!r}, backend {self.backend.name!r}); set cuda_graphs to None or False"
            )
        if not wanted:
            return None
        return DecodeGraphs(self.model, self.cache, self.backend, self.layout, self.config.max_num_seqs,
                            self.layout.blocks_for(self.max_model_len))

    def capture_decode_graphs(self, batch_sizes, max_len: int | None = None) -> int:
        """Capture the decode graphs for these batch sizes at every block-table width up to `max_len` tokens
        (default max_model_len), dense and sparse; returns how many graphs are held."""
        if self.graphs is None:
            raise RuntimeError("CUDA graphs are off (CPU, cuda_graphs=False or a non-triton backend): nothing to capture")
        modes = (False, True) if self.has_sparse_layers else (False,)
        self.graphs.capture(batch_sizes, min(max_len or self.max_model_len, self.max_model_len), modes)
        return self.graphs.num_captured

    @property
    def has_sparse_layers(self) -> bool:
        return len(self.cache.sparse_layers) > 0

    def copy_blocks(self, sources: list[int], copies: list[int]) -> None:
        """Copy whole blocks in every layer (a forked group's partial prompt block)."""
        self.cache.copy_blocks(sources, copies)

    def mark_allocated(self, blocks: list[int]) -> None:
        """The block allocator's hook: these blocks are zeroed before the next forward."""
        self._unzeroed.extend(blocks)

    def set_schedule(self, schedule: SparsitySchedule | None) -> None:
        self._schedule = schedule
        self._budget_table = None
        if schedule is not None:
            self._budget_table = schedule.budget_by_blocks(self.layout.blocks_for(self.max_model_len)).tolist()
        if self.graphs is not None:
            self.graphs.set_schedule(schedule)

    def budgets(self, lengths: list[int]) -> list[int]:
        """Budget (blocks) of a query with each context length under the schedule in force."""
        if self._budget_table is None:
            return [DENSE_BUDGET] * len(lengths)
        return [self._budget_table[self.layout.blocks_for(n)] for n in lengths]

    def load_weights(self, weights) -> None:
        """Validate all tensors first, then copy in place (a state dict or an HF directory)."""
        load_weights(self.model, weights)

    def parameters(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Copies of the served parameters; under tensor parallelism, this rank's shards."""
        params = dict(self.model.named_parameters())
        missing = [n for n in names if n not in params]
        if missing:
            raise KeyError(f"no parameters named {missing[:5]}; names are the HF checkpoint's (e.g. {next(iter(params))!r})")
        return {n: params[n].detach().cpu().clone() for n in names}

    def stats(self) -> dict:
        return {
            "kv_blocks_total": self.num_kv_blocks,
            "dtype": str(self.model.dtype).removeprefix("torch."),
            "kv_cache_dtype": self.config.kv_cache_dtype,
            "attention_backend": self.backend.name,
            "cuda_graphs": self.graphs is not None,
            "cuda_graphs_captured": 0 if self.graphs is None else self.graphs.num_captured,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "all_reduce": self.all_reduce,
            "sampler": "fused" if uses_fused_sampler(self.device, self.config.fused_sampling) else "eager",
        }

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------------ decode-graph rows

    def _row(self, seq: Sequence) -> int:
        row = self._rows.get(seq)
        if row is None:
            row = self._rows[seq] = self._free_rows.pop()
        return row

    def release_row(self, seq: Sequence) -> None:
        """The sequence stopped decoding (finished, failed or preempted); a re-prefilled one gets a row again."""
        row = self._rows.pop(seq, None)
        if row is not None:
            self._free_rows.append(row)

    # ------------------------------------------------------------------ forwards

    def _zero_new_blocks(self) -> None:
        """Zero the blocks allocated since the last forward in one call (not one per allocation)."""
        if self._unzeroed:
            self.cache.zero_blocks(self._unzeroed)
            self._unzeroed.clear()

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs = self.layout.block_size
        return [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def prefill(self, chunks: list[PrefillChunk]) -> tuple[list[Sequence], torch.Tensor | None]:
        """Compute the chunks' K/V. Returns the sequences whose cache is now complete and, per sequence, the
        logits of its last position (None when no chunk completed a sequence)."""
        self._zero_new_blocks()
        dev, bs = self.device, self.layout.block_size
        ids, positions, slots, metas = [], [], [], []
        row = 0
        for ch in chunks:
            seq, n = ch.seq, ch.end - ch.start
            ids += seq.token_ids[ch.start : ch.end]
            positions += range(ch.start, ch.end)
            slots += self._slots(seq, ch.start, ch.end)
            budgets = None
            if ch.end > seq.prompt_len and self.has_sparse_layers:
                row_budgets = seq.query_budgets(ch.start, ch.end, self.budgets([seq.num_tokens])[0])
                nb = [p // bs + 1 for p in range(ch.start, ch.end)]
                if any(b < k for b, k in zip(row_budgets, nb)):
                    budgets = torch.tensor(row_budgets, device=dev)
            metas.append(PrefillChunkMeta(
                rows=slice(row, row + n), start=ch.start, end=ch.end,
                block_table=torch.tensor(seq.block_table[: self.layout.blocks_for(ch.end)], device=dev),
                positions=torch.arange(ch.start, ch.end, device=dev), budgets=budgets,
            ))
            row += n
        attention = PagedPrefill(self.cache, self.backend, self.layout, torch.tensor(slots, device=dev), metas)
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), attention)
        done = [(ch, m) for ch, m in zip(chunks, metas) if ch.end == ch.seq.num_tokens]
        for ch in chunks:
            ch.seq.num_cached = ch.end
            ch.seq.prefilled = ch.end == ch.seq.num_tokens
        if not done:
            return [], None
        return [ch.seq for ch, _ in done], self.model.logits(hidden[[m.rows.stop - 1 for _, m in done]])

    def first_tokens(self, seqs: list[Sequence], logits: torch.Tensor) -> Draws:
        """Draw the next token of sequences whose cache a prefill just completed (`logits` one row each):
        they get their decode-graph rows, and a recomputed sequence's newest query keeps its decode budget."""
        if self.graphs is not None:
            for seq in seqs:
                self.graphs.write_table(self._row(seq), seq.block_table)
        budgets = []
        for seq in seqs:
            if seq.num_tokens > seq.prompt_len:  # recomputed sequence: its newest query is a decode query
                seq.budgets.append(self.budgets([seq.num_tokens])[0])
                budgets.append(seq.budgets[-1])
            else:
                budgets.append(DENSE_BUDGET)
        lengths = torch.tensor([seq.num_tokens for seq in seqs])
        blocks = blocks_attended(lengths, torch.tensor(budgets) if self.has_sparse_layers else None, self.layout)
        return PendingDraws.launch(sample(logits, self._sampling_batch(seqs), self.config.fused_sampling),
                                   blocks.to(self.device)).resolve()

    def decode(self, seqs: list[Sequence]) -> Draws:
        """One token for every sequence (each has a block for it), then the next token drawn."""
        return self.launch_decode(seqs).resolve()

    def launch_decode(self, seqs: list[Sequence], fed: torch.Tensor | None = None) -> "PendingDraws":
        """Launch one decode step and its sampling; the drawn tokens reach the host asynchronously.

        `fed`: the tokens to feed, on the device (the previous step's draws, not yet on the host: each
        sequence is then one token longer than its host-side `token_ids`); None = each one's last token.
        """
        self._zero_new_blocks()
        ahead = 0 if fed is None else 1
        bs = self.layout.block_size
        lengths = [s.num_tokens + ahead for s in seqs]
        sampling = self._sampling_batch(seqs, lengths)
        budgets = self.budgets(lengths)
        for seq, b in zip(seqs, budgets):
            seq.budgets.append(b)
        sparse = self.has_sparse_layers and any(b < self.layout.blocks_for(n) for b, n in zip(budgets, lengths))
        if self.graphs is not None:
            logits, blocks = self.graphs.run(
                [self._rows[s] for s in seqs], None if fed is not None else [s.token_ids[-1] for s in seqs], lengths,
                [s.block_table[(n - 1) // bs] for s, n in zip(seqs, lengths)], sparse, fed,
            )
        else:
            logits, blocks = self._decode_eager(seqs, lengths, budgets, sparse, fed)
        for seq, n in zip(seqs, lengths):
            seq.num_cached = n
        return PendingDraws.launch(sample(logits, sampling, self.config.fused_sampling), blocks)

    def _decode_eager(self, seqs: list[Sequence], lengths: list[int], budgets: list[int], sparse: bool,
                      fed: torch.Tensor | None):
        dev, bs = self.device, self.layout.block_size
        width = max(self.layout.blocks_for(n) for n in lengths)
        tables = [s.block_table[:width] + [0] * (width - len(s.block_table[:width])) for s in seqs]
        seq_lens = torch.tensor(lengths, device=dev)
        attention = PagedDecode(
            self.cache, self.backend, self.layout,
            slots=torch.tensor([s.block_table[(n - 1) // bs] * bs + (n - 1) % bs for s, n in zip(seqs, lengths)], device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev), seq_lens=seq_lens,
            budgets=torch.tensor(budgets, device=dev) if sparse else None, scale=self.spec.head_dim**-0.5,
        )
        ids = fed if fed is not None else torch.tensor([s.token_ids[-1] for s in seqs], device=dev)
        logits = self.model.logits(self.model(ids, seq_lens - 1, attention))
        blocks = attention.blocks_attended
        if blocks is None:
            blocks = blocks_attended(seq_lens, None, self.layout)
        return logits, blocks

    # ------------------------------------------------------------------ sampling

    def _sampling_batch(self, seqs: list[Sequence], positions: list[int] | None = None) -> SamplingBatch:
        """`positions`: the index each row's next token takes (default: each sequence's length)."""
        positions = [s.num_tokens for s in seqs] if positions is None else positions
        return SamplingBatch.build([s.sampling for s in seqs], [s.seed for s in seqs], positions, self.device)

