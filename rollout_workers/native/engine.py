"""`NativeEngine`: Sparrow's own rollout engine (paged KV cache, block-sparse decode, continuous batching).

A step is a prefill step (new prompts, chunks of long prompts, recomputation of preempted sequences)
or a decode step over every running sequence, batched into one forward pass. See
docs/native_engine.md for the cache layout, the allocator and how blocks attended are counted.
"""

import asyncio
import contextlib
import os
import random
import time
from collections.abc import AsyncIterator, Sequence as Seq
from pathlib import Path

import torch
from tqdm import tqdm

from sparrow.kernels import make_backend
from sparrow.rollout_workers.api import RolloutEngine, RolloutRequest, RolloutSample, WeightsSource
from sparrow.schedule import DENSE_BUDGET, SparsitySchedule, load_schedule
from sparrow.seeds import sample_seed

from .attention import PagedDecode, PagedPrefill, PrefillChunkMeta, blocks_attended
from .block_manager import BlockManager
from .config import NativeEngineConfig
from .cuda_graphs import DecodeGraphs, budget_table
from .kv_cache import KVCache, bytes_per_block
from .model import DecoderModel
from .model_spec import ModelLoadError, load_spec
from .sampler import SampleOutput, SamplingBatch, sample
from .scheduler import PrefillChunk, Scheduler, blocks_for
from .sequence import Sequence
from .teacher_forced import TeacherForcedOutput, teacher_forced_logprobs
from .weights import copy_weights, read_checkpoint, validated_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r}: CUDA is not available on this machine; use device='cpu'")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


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


def load_model(model_dir: str | Path, device="cpu", dtype=torch.float32, max_model_len: int | None = None) -> DecoderModel:
    """An HF directory's model with its weights, ready for the engine or `teacher_forced_logprobs`."""
    spec = load_spec(model_dir)
    max_len = max_model_len or spec.max_position_embeddings
    if max_len > spec.max_position_embeddings:
        raise ModelLoadError(
            f"max_model_len={max_len} exceeds the model's max_position_embeddings={spec.max_position_embeddings} "
            f"({Path(model_dir) / 'config.json'}); lower max_model_len"
        )
    model = DecoderModel(spec, max_len, device=device, dtype=dtype)
    copy_weights(model, validated_weights(model, read_checkpoint(model_dir)))
    return model


class NativeEngine(RolloutEngine):
    """Rollouts on CPU or CUDA from an HF directory (`NativeEngineConfig.model`) or a built model.

    Not thread-safe: one `generate` or `stream` at a time; weights and schedule change between them.
    """

    def __init__(self, config: NativeEngineConfig, model: DecoderModel | None = None):
        self.config = config
        self.device = resolve_device(config.device)
        if model is None:
            if config.model is None:
                raise ValueError("NativeEngineConfig.model is not set: give an HF model directory (config.json + safetensors)")
            model = load_model(config.model, self.device, resolve_dtype(config.dtype, self.device), config.max_model_len)
        self.model = model
        self.spec = model.spec
        self.max_model_len = min(config.max_model_len or self.spec.max_position_embeddings, model.rope.cos.shape[0])
        self.attention = config.layout()
        self.attention.check_layers(self.spec.num_layers)
        self.backend = make_backend(config.attention_backend, self.device)
        self.num_kv_blocks = self._num_kv_blocks()
        self.cache = KVCache(self.spec, self.attention, self.num_kv_blocks, model.dtype, self.device)
        self._unzeroed: list[int] = []
        """Blocks allocated since the last forward; zeroed together, once, before it (`_zero_new_blocks`)."""
        self.blocks = BlockManager(self.num_kv_blocks, on_allocate=self._unzeroed.extend)
        self.scheduler = Scheduler(self.blocks, self.attention.block_size, config.max_num_seqs, config.prefill_chunk_size)
        self._graphs = self._decode_graphs()
        self._rows: dict[Sequence, int] = {}
        """Row slot of each sequence in the decode graphs' block-table buffer."""
        self._free_rows = list(range(config.max_num_seqs))[::-1]
        self.eos_token_ids = frozenset(self.spec.eos_token_ids)
        self._rng = random.Random(config.seed)
        self._policy_version = 0
        self._schedule: SparsitySchedule | None = None
        self._budget_table: list[int] | None = None
        """Budget (blocks) by a context's block count under the active schedule, for O(1) lookups per row."""
        self._active = False
        self._counters = dict.fromkeys(
            ("tokens_generated", "prefill_tokens", "decode_tokens", "prefill_steps", "decode_steps",
             "samples_finished", "samples_failed"), 0)
        self._seconds = {"prefill": 0.0, "decode": 0.0}
        if config.schedule:
            self.set_schedule(load_schedule(config.schedule))

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
        max_blocks = blocks_for(self.max_model_len, self.attention.block_size)
        return DecodeGraphs(self.model, self.cache, self.backend, self.attention, self.config.max_num_seqs, max_blocks)

    def capture_decode_graphs(self, batch_sizes, max_len: int | None = None) -> int:
        """Capture the decode graphs for these batch sizes at every block-table width up to `max_len` tokens
        (default max_model_len), dense and sparse, so no capture happens mid-generation; returns how many
        graphs the engine holds. Without this, each graph is captured the first time a step needs it."""
        if self._graphs is None:
            raise RuntimeError("CUDA graphs are off (CPU, cuda_graphs=False or a non-triton backend): nothing to capture")
        modes = (False, True) if self._has_sparse_layers() else (False,)
        self._graphs.capture(batch_sizes, min(max_len or self.max_model_len, self.max_model_len), modes)
        return self._graphs.num_captured

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, **overrides) -> "NativeEngine":
        return cls(NativeEngineConfig(model=str(model_dir), **overrides))

    def _num_kv_blocks(self) -> int:
        per_block = bytes_per_block(self.spec, self.attention, self.model.dtype)
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        ceiling = self.config.max_num_seqs * blocks_for(self.max_model_len, self.attention.block_size)
        budget = int(self.config.kv_memory_fraction * free_memory_bytes(self.device)) // per_block
        if budget < 1:
            raise ValueError(
                f"kv_memory_fraction={self.config.kv_memory_fraction} leaves no room for one KV block "
                f"({per_block} bytes); raise it or set num_kv_blocks"
            )
        return min(ceiling, budget)

    # ------------------------------------------------------------------ RolloutEngine contract

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def schedule(self) -> SparsitySchedule | None:
        return self._schedule

    def set_schedule(self, schedule: SparsitySchedule | None) -> None:
        self.attention.check_compatible(schedule)
        self._schedule = schedule
        self._budget_table = None
        if schedule is not None:
            self._budget_table = budget_table(schedule, blocks_for(self.max_model_len, self.attention.block_size)).tolist()
        if self._graphs is not None:
            self._graphs.set_schedule(schedule)

    def load_weights(self, weights: WeightsSource, version: int) -> None:
        """Validate all tensors first, then copy in place; on any error the old weights and version stay."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version={version!r}: must be an integer >= 0")
        if self.scheduler.has_work():
            raise RuntimeError(
                f"load_weights with {len(self.scheduler.running) + len(self.scheduler.waiting)} sequences in flight; "
                "call it between generate() calls"
            )
        if isinstance(weights, (str, Path)):
            weights = read_checkpoint(weights)
        copy_weights(self.model, validated_weights(self.model, weights))
        self._policy_version = version

    def generate(self, requests: Seq[RolloutRequest], progress: bool = False) -> list[RolloutSample]:
        """`progress` shows a bar of tokens (at most max_tokens per sample; a sample that stops early
        is counted in full when it finishes), which moves even while all samples are still running."""
        order = {id(r): i for i, r in enumerate(requests)}
        results: list[tuple[RolloutRequest, RolloutSample]] = []
        budget = sum(_num_samples(r) * r.sampling.max_tokens for r in requests)
        with self._session(), tqdm(total=budget, disable=not progress, desc="generate", unit="tok") as bar:
            for request in requests:
                results += [(request, s) for s in self.add_request(request)]
            while self.scheduler.has_work():
                before = self._counters["tokens_generated"]
                finished = self._step()
                unused = sum(r.sampling.max_tokens - len(s.token_ids) for r, s in finished)
                bar.update(self._counters["tokens_generated"] - before + unused)
                results += finished
        results.sort(key=lambda pair: (order[id(pair[0])], pair[1].sample_index))
        return [s for _, s in results]

    async def stream(self, requests: Seq[RolloutRequest]) -> AsyncIterator[RolloutSample]:
        with self._session():
            for request in requests:
                for failed in self.add_request(request):
                    yield failed
            while self.scheduler.has_work():
                for _, done in await asyncio.to_thread(self._step):
                    yield done

    def stats(self) -> dict:
        c, busy = self._counters, sum(self._seconds.values())
        return {
            **c,
            "tokens_per_s": c["tokens_generated"] / busy if busy else 0.0,
            "decode_tokens_per_s": c["decode_tokens"] / self._seconds["decode"] if self._seconds["decode"] else 0.0,
            "busy_seconds": busy,
            "prefill_seconds": self._seconds["prefill"],
            "decode_seconds": self._seconds["decode"],
            "kv_blocks_total": self.num_kv_blocks,
            "kv_blocks_used": self.blocks.num_used,
            "kv_blocks_free": self.blocks.num_free,
            "kv_blocks_shared": self.blocks.num_shared,
            "prefix_blocks_saved": self.blocks.blocks_saved_by_sharing,
            "preemptions": self.scheduler.num_preemptions,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "policy_version": self._policy_version,
            "schedule_version": self.schedule_version,
            "schedule": None if self._schedule is None else self._schedule.name,
            "attention_backend": self.backend.name,
            "cuda_graphs": self._graphs is not None,
            "cuda_graphs_captured": 0 if self._graphs is None else self._graphs.num_captured,
        }

    def teacher_forced_logprobs(self, token_ids, prompt_len: int, schedule: SparsitySchedule | None = None,
                                temperature: float = 1.0, full: bool = False) -> TeacherForcedOutput:
        """`teacher_forced_logprobs` with this engine's model and attention settings."""
        return teacher_forced_logprobs(self.model, token_ids, prompt_len, schedule, self.attention, temperature, full)

    # ------------------------------------------------------------------ requests and steps

    @contextlib.contextmanager
    def _session(self):
        """One generate/stream call; whatever it leaves unfinished (a stream closed early) is dropped."""
        if self._active:
            raise RuntimeError("the engine is already serving a generate/stream call; run them one at a time")
        self._active = True
        try:
            yield
        finally:
            self._abort_all()
            self._active = False

    def _abort_all(self) -> None:
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self._finish(seq)

    def abort(self) -> None:
        """Drop every unfinished sequence (their samples are not returned); for callers driving `step`."""
        if self._active:
            raise RuntimeError("abort() while a generate/stream call runs; close the stream instead")
        self._abort_all()

    def _finish(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        row = self._rows.pop(seq, None)
        if row is not None:
            self._free_rows.append(row)

    def _row(self, seq: Sequence) -> int:
        """The sequence's row slot in the decode graphs; rows of preempted sequences are reclaimed when
        none is free (a preempted sequence gets its row, and its table, again when re-prefilled)."""
        row = self._rows.get(seq)
        if row is None:
            if not self._free_rows:
                running = set(self.scheduler.running)
                for other in [s for s in self._rows if s not in running]:
                    self._free_rows.append(self._rows.pop(other))
            row = self._free_rows.pop()
            self._rows[seq] = row
        return row

    def _validate(self, request: RolloutRequest) -> None:
        request.sampling.validate()
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError(f"request {request.request_id!r}: prompt_token_ids is empty; give at least one token")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < self.spec.vocab_size]
        if bad:
            raise ValueError(f"request {request.request_id!r}: token ids {bad[:5]} are outside the vocabulary [0, {self.spec.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: the prompt has {len(prompt)} tokens but max_model_len is "
                f"{self.max_model_len} (prompt + generated tokens); shorten the prompt or raise max_model_len"
            )
        n = request.sampling.n
        if n > self.config.max_num_seqs:
            raise ValueError(f"request {request.request_id!r}: n={n} exceeds max_num_seqs={self.config.max_num_seqs}; raise max_num_seqs")
        bs = self.attention.block_size
        needed = blocks_for(len(prompt), bs) + ((n - 1) if len(prompt) % bs else 0)
        if needed > self.num_kv_blocks:
            raise ValueError(
                f"request {request.request_id!r}: the prompt needs {needed} KV blocks but the pool has "
                f"{self.num_kv_blocks}; raise num_kv_blocks or kv_memory_fraction"
            )

    def add_request(self, request: RolloutRequest) -> list[RolloutSample]:
        """Queue a request's samples; returns them at once as errors if the request is invalid."""
        try:
            self._validate(request)
        except ValueError as exc:
            n = _num_samples(request)
            self._counters["samples_failed"] += n
            return [RolloutSample.failed(request, j, str(exc), self._policy_version, self.schedule_version) for j in range(n)]
        base = request.sampling.seed if request.sampling.seed is not None else self._rng.getrandbits(63)
        leader = Sequence(
            request=request, sample_index=0, seed=sample_seed(base, 0),
            token_ids=list(request.prompt_token_ids), prompt_len=len(request.prompt_token_ids),
            fork_into=request.sampling.n, seed_base=base,
        )
        self.scheduler.add(leader)
        return []

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RolloutSample]:
        """Run one prefill or decode step; returns the samples that finished in it."""
        return [s for _, s in self._step()]

    @torch.inference_mode()
    def _step(self) -> list[tuple[RolloutRequest, RolloutSample]]:
        start = time.perf_counter()
        finished: list[tuple[RolloutRequest, RolloutSample]] = []
        chunks, impossible = self.scheduler.schedule_prefill()
        for seq in impossible:
            finished += self._fail(seq, "the KV cache cannot hold this sequence even alone; raise num_kv_blocks")
        if chunks:
            finished += self._prefill(chunks)
            phase = "prefill"
        else:
            seqs, stuck = self.scheduler.schedule_decode()
            for seq in stuck:
                finished += self._fail(seq, f"KV cache exhausted at {seq.num_tokens} tokens with no sequence left to "
                                            f"preempt (pool of {self.num_kv_blocks} blocks); raise num_kv_blocks")
            if seqs:
                finished += self._decode(seqs)
            phase = "decode"
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._seconds[phase] += time.perf_counter() - start
        return finished

    def _budgets(self, lengths: list[int]) -> list[int]:
        if self._budget_table is None:
            return [DENSE_BUDGET] * len(lengths)
        bs = self.attention.block_size
        return [self._budget_table[(n + bs - 1) // bs] for n in lengths]

    def _zero_new_blocks(self) -> None:
        """Zero the blocks allocated since the last forward in one call (not one per allocation)."""
        if self._unzeroed:
            self.cache.zero_blocks(self._unzeroed)
            self._unzeroed.clear()

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs = self.attention.block_size
        return [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]

    def _prefill(self, chunks: list[PrefillChunk]) -> list[tuple[RolloutRequest, RolloutSample]]:
        self._zero_new_blocks()
        dev = self.device
        ids, positions, slots, metas = [], [], [], []
        row = 0
        for ch in chunks:
            seq, n = ch.seq, ch.end - ch.start
            ids += seq.token_ids[ch.start : ch.end]
            positions += range(ch.start, ch.end)
            slots += self._slots(seq, ch.start, ch.end)
            budgets = None
            if ch.end > seq.prompt_len and self._has_sparse_layers():
                last = self._budgets([seq.num_tokens])[0]
                row_budgets = seq.query_budgets(ch.start, ch.end, last)
                nb = [p // self.attention.block_size + 1 for p in range(ch.start, ch.end)]
                if any(b < k for b, k in zip(row_budgets, nb)):
                    budgets = torch.tensor(row_budgets, device=dev)
            metas.append(PrefillChunkMeta(
                rows=slice(row, row + n), start=ch.start, end=ch.end,
                block_table=torch.tensor(seq.block_table[: blocks_for(ch.end, self.attention.block_size)], device=dev),
                positions=torch.arange(ch.start, ch.end, device=dev), budgets=budgets,
            ))
            row += n
        attention = PagedPrefill(self.cache, self.backend, self.attention, torch.tensor(slots, device=dev), metas)
        hidden = self.model(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), attention)
        self._counters["prefill_tokens"] += len(ids)
        self._counters["prefill_steps"] += 1

        done = [(ch, m) for ch, m in zip(chunks, metas) if ch.end == ch.seq.num_tokens]
        for ch in chunks:
            ch.seq.num_cached = ch.end
            ch.seq.prefilled = ch.end == ch.seq.num_tokens
        if not done:
            return []
        logits = self.model.logits(hidden[[m.rows.stop - 1 for _, m in done]])
        seqs, rows, lengths = [], [], []
        for i, (ch, _) in enumerate(done):
            group = self._fork(ch.seq) if ch.seq.fork_into > 1 else [ch.seq]
            seqs += group
            rows += [i] * len(group)
            lengths += [ch.seq.num_tokens] * len(group)
        if self._graphs is not None:
            for seq in seqs:
                self._graphs.write_table(self._row(seq), seq.block_table)
        budgets = []
        for seq in seqs:
            if seq.num_tokens > seq.prompt_len:  # recomputed sequence: its newest query is a decode query
                seq.budgets.append(self._budgets([seq.num_tokens])[0])
                budgets.append(seq.budgets[-1])
            else:
                budgets.append(DENSE_BUDGET)
        blocks = blocks_attended(torch.tensor(lengths), torch.tensor(budgets) if self._has_sparse_layers() else None,
                                 self.attention).to(dev)
        return self._sample_and_record(seqs, logits[rows], blocks)

    def _fork(self, leader: Sequence) -> list[Sequence]:
        """Turn a group leader whose prompt is cached into its n samples: full blocks are shared
        (ref-counted), the partial last block is copied into each extra sample's reserved block."""
        bs = self.attention.block_size
        full = leader.num_tokens // bs
        shared, partial = leader.block_table[:full], leader.block_table[full:]
        copies = list(leader.reserved_blocks)
        if partial:
            self.cache.copy_blocks(partial * len(copies), copies)
        group = [leader]
        for j in range(1, leader.fork_into):
            seq = Sequence(
                request=leader.request, sample_index=j,
                seed=sample_seed(leader.seed_base, j), token_ids=list(leader.token_ids), prompt_len=leader.prompt_len,
                num_cached=leader.num_cached, prefilled=True,
                block_table=self.blocks.share(shared) + ([copies[j - 1]] if partial else []),
            )
            group.append(seq)
            self.scheduler.running.append(seq)
        leader.fork_into, leader.reserved_blocks = 1, []
        return group

    def _decode(self, seqs: list[Sequence]) -> list[tuple[RolloutRequest, RolloutSample]]:
        self._zero_new_blocks()
        # Built before the forward: its host-to-device copies synchronize, which after the forward would
        # stall the host until the GPU is done and expose the sampler's launches.
        sampling = self._sampling_batch(seqs)
        bs = self.attention.block_size
        lengths = [s.num_tokens for s in seqs]
        budgets = self._budgets(lengths)
        for seq, b in zip(seqs, budgets):
            seq.budgets.append(b)
        sparse = self._has_sparse_layers() and any(b < blocks_for(n, bs) for b, n in zip(budgets, lengths))
        if self._graphs is not None:
            logits, blocks = self._graphs.run(
                [self._rows[s] for s in seqs], [s.token_ids[-1] for s in seqs], lengths,
                [s.block_table[(n - 1) // bs] for s, n in zip(seqs, lengths)], sparse,
            )
        else:
            logits, blocks = self._decode_eager(seqs, lengths, budgets, sparse)
        for seq in seqs:
            seq.num_cached = seq.num_tokens
        self._counters["decode_tokens"] += len(seqs)
        self._counters["decode_steps"] += 1
        return self._sample_and_record(seqs, logits, blocks, sampling)

    def _decode_eager(self, seqs: list[Sequence], lengths: list[int], budgets: list[int], sparse: bool):
        dev, bs = self.device, self.attention.block_size
        width = max(blocks_for(n, bs) for n in lengths)
        tables = [s.block_table[:width] + [0] * (width - len(s.block_table[:width])) for s in seqs]
        seq_lens = torch.tensor(lengths, device=dev)
        attention = PagedDecode(
            self.cache, self.backend, self.attention,
            slots=torch.tensor([s.block_table[(n - 1) // bs] * bs + (n - 1) % bs for s, n in zip(seqs, lengths)], device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev), seq_lens=seq_lens,
            budgets=torch.tensor(budgets, device=dev) if sparse else None, scale=self.spec.head_dim**-0.5,
        )
        ids = torch.tensor([s.token_ids[-1] for s in seqs], device=dev)
        logits = self.model.logits(self.model(ids, seq_lens - 1, attention))
        blocks = attention.blocks_attended
        if blocks is None:
            blocks = blocks_attended(seq_lens, None, self.attention)
        return logits, blocks

    def _has_sparse_layers(self) -> bool:
        return len(self.cache.sparse_layers) > 0

    def _sampling_batch(self, seqs: list[Sequence]) -> SamplingBatch:
        return SamplingBatch.build([s.sampling for s in seqs], [s.seed for s in seqs], [s.num_tokens for s in seqs],
                                   self.device)

    def _sample_and_record(self, seqs: list[Sequence], logits: torch.Tensor, blocks: torch.Tensor,
                           sampling: SamplingBatch | None = None):
        """Draw the next token of every sequence; the step's only device-to-host copy is the tokens
        with their finiteness flags (logprobs and top-k lists stay on the device until a sample ends)."""
        if sampling is None:
            sampling = self._sampling_batch(seqs)
        out: SampleOutput = sample(logits, sampling)
        tokens, finite = torch.stack([out.tokens, out.finite.long()]).tolist()
        finished = []
        version = self.schedule_version
        for row, (seq, token, ok) in enumerate(zip(seqs, tokens, finite)):
            if not ok:
                finished += self._fail(seq, f"non-finite logits at position {seq.num_tokens - 1}")
                continue
            seq.record(out, blocks, row, token, version)
            self._counters["tokens_generated"] += 1
            reason = self._stop_reason(seq, token)
            if reason:
                seq.finish_reason = reason
                self._finish(seq)
                self._counters["samples_finished"] += 1
                finished.append((seq.request, seq.to_sample(self._policy_version)))
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        sp = seq.sampling
        if (token in self.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            return "stop"
        if seq.num_generated >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _fail(self, seq: Sequence, error: str) -> list[tuple[RolloutRequest, RolloutSample]]:
        """Fail one sample, or every sample of a group leader that has not forked yet."""
        self._finish(seq)
        indices = range(seq.fork_into) if seq.fork_into > 1 else [seq.sample_index]
        self._counters["samples_failed"] += len(indices)
        return [(seq.request, RolloutSample.failed(seq.request, j, error, self._policy_version, self.schedule_version))
                for j in indices]


def _num_samples(request: RolloutRequest) -> int:
    n = request.sampling.n
    return n if isinstance(n, int) and n > 0 else 1
