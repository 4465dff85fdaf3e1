"""`Scheduler`: which sequences run each step, and when they stop.

- Admission: a request the engine can serve (`check`) is queued as one group leader that will become
  its `n` samples. Each step is either a prefill step or a decode step over all running sequences.
- Prefill first: sequences whose cache is incomplete (new prompts, preempted sequences) get up to
  `prefill_chunk_size` tokens per step, long ones over several steps (chunked prefill). A sequence
  is admitted FIFO when the running set has room for all samples it will become and the pool has
  blocks for all its tokens (plus one copy of the partial prompt block per extra sample). A leader
  whose prompt is cached forks into its samples (`fork`): full blocks shared, the partial one copied.
- Decode: every running sequence advances one token. A sequence entering a new block takes one
  from the pool; when none is free the most recently admitted sequence is preempted — its blocks
  are released and it goes back to the front of the queue to be recomputed later.
- Stop and finish: a sample stops at EOS (unless `ignore_eos`), at a stop id, at `max_tokens` or at
  `max_model_len` (`postprocess`); a finished, failed or aborted sequence releases its blocks (`finish`).
"""

from collections import deque
from dataclasses import dataclass

from sparrow.layout import SparseAttentionConfig
from sparrow.rollout_workers.api import RolloutRequest
from sparrow.seeds import sample_seed

from .block_manager import BlockManager
from .sequence import Draws, Sequence


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    end: int


@dataclass
class DecodeBatch:
    seqs: list[Sequence]
    """To decode this step, each with a block for its new token."""
    stuck: list[Sequence]
    """Cannot get a block even with every other sequence preempted (to be failed)."""
    preempted: list[Sequence]
    """Sent back to the queue this step, their blocks released."""


class Scheduler:
    def __init__(self, blocks: BlockManager, layout: SparseAttentionConfig, max_num_seqs: int, prefill_chunk_size: int,
                 max_model_len: int, vocab_size: int, eos_token_ids):
        self.blocks = blocks
        self.layout = layout
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk_size = prefill_chunk_size
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ admission

    def check(self, request: RolloutRequest) -> None:
        """Raise ValueError naming the field, the value and the fix if the engine can never serve `request`."""
        request.sampling.validate()
        prompt = request.prompt_token_ids
        if not prompt:
            raise ValueError(f"request {request.request_id!r}: prompt_token_ids is empty; give at least one token")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"request {request.request_id!r}: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r}: the prompt has {len(prompt)} tokens but max_model_len is "
                f"{self.max_model_len} (prompt + generated tokens); shorten the prompt or raise max_model_len"
            )
        n = request.sampling.n
        if n > self.max_num_seqs:
            raise ValueError(f"request {request.request_id!r}: n={n} exceeds max_num_seqs={self.max_num_seqs}; raise max_num_seqs")
        needed = self.layout.blocks_for(len(prompt)) + ((n - 1) if len(prompt) % self.layout.block_size else 0)
        if needed > self.blocks.num_blocks:
            raise ValueError(
                f"request {request.request_id!r}: the prompt needs {needed} KV blocks but the pool has "
                f"{self.blocks.num_blocks}; raise num_kv_blocks or kv_memory_fraction"
            )

    def add(self, request: RolloutRequest, seed_base: int) -> None:
        """Queue a checked request as the leader of its `n` samples (sample j is seeded sample_seed(seed_base, j))."""
        self.waiting.append(Sequence(
            request=request, sample_index=0, seed=sample_seed(seed_base, 0),
            token_ids=list(request.prompt_token_ids), prompt_len=len(request.prompt_token_ids),
            fork_into=request.sampling.n, seed_base=seed_base,
        ))

    def admission_blocks(self, seq: Sequence) -> tuple[int, int]:
        """(blocks for the sequence's tokens, copies of the partial prompt block for its forks)."""
        partial = seq.num_tokens % self.layout.block_size != 0
        return self.layout.blocks_for(seq.num_tokens), (seq.fork_into - 1) if partial else 0

    # ------------------------------------------------------------------ steps

    def schedule_prefill(self) -> tuple[list[PrefillChunk], list[Sequence]]:
        """Chunks to compute this step, and waiting sequences that can never fit (to be failed)."""
        budget = self.prefill_chunk_size
        chunks: list[PrefillChunk] = []
        for seq in self.running:
            if budget and not seq.prefilled:
                end = min(seq.num_tokens, seq.num_cached + budget)
                chunks.append(PrefillChunk(seq, seq.num_cached, end))
                budget -= end - seq.num_cached
        impossible: list[Sequence] = []
        while self.waiting and budget:
            seq = self.waiting[0]
            blocks, copies = self.admission_blocks(seq)
            committed = sum(s.fork_into for s in self.running)
            if committed + seq.fork_into > self.max_num_seqs or blocks + copies > self.blocks.num_free:
                if not self.running and not chunks:
                    impossible.append(self.waiting.popleft())
                    continue
                break
            self.waiting.popleft()
            seq.block_table = self.blocks.allocate(blocks)
            seq.reserved_blocks = self.blocks.allocate(copies)
            self.running.append(seq)
            end = min(seq.num_tokens, budget)
            chunks.append(PrefillChunk(seq, 0, end))
            budget -= end
        return chunks, impossible

    def schedule_decode(self) -> DecodeBatch:
        batch = DecodeBatch([], [], [])
        candidates = deque(self.running)
        while candidates:
            seq = candidates.popleft()
            needs_block = len(seq.block_table) < self.layout.blocks_for(seq.num_tokens)
            while needs_block and self.blocks.num_free == 0 and candidates:
                batch.preempted.append(self.preempt(candidates.pop()))
            if needs_block and self.blocks.num_free == 0:
                if batch.seqs:
                    batch.preempted.append(self.preempt(seq))
                else:
                    batch.stuck.append(seq)
                continue
            if needs_block:
                seq.block_table += self.blocks.allocate(1)
            batch.seqs.append(seq)
        return batch

    def reserve_next(self, seqs: list[Sequence]) -> bool:
        """Blocks for one token more than each sequence holds on the host (its next token, drawn but not yet
        read), for every sequence or for none; False when the pool lacks them (no one is preempted)."""
        short = [s for s in seqs if len(s.block_table) < self.layout.blocks_for(s.num_tokens + 1)]
        if len(short) > self.blocks.num_free:
            return False
        for seq in short:
            seq.block_table += self.blocks.allocate(1)
        return True

    def preempt(self, seq: Sequence) -> Sequence:
        self.blocks.release(seq.block_table + seq.reserved_blocks)
        seq.block_table, seq.reserved_blocks = [], []
        seq.num_cached = 0
        seq.prefilled = False
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        return seq

    def fork(self, leader: Sequence) -> tuple[list[Sequence], list[int], list[int]]:
        """Turn a group leader whose prompt is cached into its n samples: full blocks are shared
        (ref-counted), the partial last block goes to each extra sample's reserved block. Returns the
        group and the block copies (sources, destinations) to make before any of them decodes."""
        full = leader.num_tokens // self.layout.block_size
        shared, partial = leader.block_table[:full], leader.block_table[full:]
        copies = list(leader.reserved_blocks)
        group = [leader]
        for j in range(1, leader.fork_into):
            seq = Sequence(
                request=leader.request, sample_index=j,
                seed=sample_seed(leader.seed_base, j), token_ids=list(leader.token_ids), prompt_len=leader.prompt_len,
                num_cached=leader.num_cached, prefilled=True,
                block_table=self.blocks.share(shared) + ([copies[j - 1]] if partial else []),
            )
            group.append(seq)
            self.running.append(seq)
        leader.fork_into, leader.reserved_blocks = 1, []
        return group, (partial * len(copies) if partial else []), (copies if partial else [])

    # ------------------------------------------------------------------ stop and finish

    def postprocess(self, seqs: list[Sequence], draws: Draws, schedule_version: int,
                    rows: list[int] | None = None) -> list[tuple[Sequence, str | None]]:
        """Record each sequence's drawn token (from its row of the step's batch; default: rows in order).
        Returns, in row order, the sequences that ended this step: (sequence, None) when it stopped (its
        `finish_reason` is set), (sequence, error) when its logits were not finite. The caller finishes them."""
        ended: list[tuple[Sequence, str | None]] = []
        for row, seq in zip(range(len(seqs)) if rows is None else rows, seqs):
            if not draws.finite[row]:
                ended.append((seq, f"non-finite logits at position {seq.num_tokens - 1}"))
                continue
            seq.record(draws, row, schedule_version)
            reason = self.stop_reason(seq)
            if reason:
                seq.finish_reason = reason
                ended.append((seq, None))
        return ended

    def runs_past_next(self, seq: Sequence) -> bool:
        """The sequence goes on after its next token whatever that token is: the token is not its last by
        `max_tokens` or `max_model_len` (a stop token shows only once the token is read)."""
        return seq.num_generated + 1 < seq.sampling.max_tokens and seq.num_tokens + 1 < self.max_model_len

    def stop_reason(self, seq: Sequence) -> str | None:
        """Why the sequence stops after its newest token, or None."""
        sp, token = seq.sampling, seq.token_ids[-1]
        if (token in self.eos_token_ids and not sp.ignore_eos) or token in sp.stop_token_ids:
            return "stop"
        if seq.num_generated >= sp.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence) -> None:
        """Release a sequence's blocks; it leaves the running set or the queue."""
        self.blocks.release(seq.block_table + seq.reserved_blocks)
        seq.block_table, seq.reserved_blocks = [], []
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def unfinished(self, request_id: str | None = None) -> list[Sequence]:
        """Sequences in flight (of one request, or all), running ones first."""
        return [s for s in (*self.running, *self.waiting) if request_id is None or s.request.request_id == request_id]
