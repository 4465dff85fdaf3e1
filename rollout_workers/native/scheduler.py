"""Continuous batching: each step is either a prefill step or a decode step over all running sequences.

- Prefill first: sequences whose cache is incomplete (new prompts, preempted sequences) get up to
  `prefill_chunk_size` tokens per step, long ones over several steps (chunked prefill). A sequence
  is admitted FIFO when the running set has room for all samples it will become and the pool has
  blocks for all its tokens (plus one copy of the partial prompt block per extra sample).
- Decode: every running sequence advances one token. A sequence entering a new block takes one
  from the pool; when none is free the most recently admitted sequence is preempted — its blocks
  are released and it goes back to the front of the queue to be recomputed later.
"""

from collections import deque
from dataclasses import dataclass

from .block_manager import BlockManager
from .sequence import Sequence


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    end: int


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Scheduler:
    def __init__(self, blocks: BlockManager, block_size: int, max_num_seqs: int, prefill_chunk_size: int):
        self.blocks = blocks
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk_size = prefill_chunk_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def admission_blocks(self, seq: Sequence) -> tuple[int, int]:
        """(blocks for the sequence's tokens, copies of the partial prompt block for its forks)."""
        partial = seq.num_tokens % self.block_size != 0
        return blocks_for(seq.num_tokens, self.block_size), (seq.fork_into - 1) if partial else 0

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

    def schedule_decode(self) -> tuple[list[Sequence], list[Sequence]]:
        """Sequences to decode this step (each with a block for its new token), and sequences that
        cannot get a block even with every other sequence preempted (to be failed)."""
        scheduled: list[Sequence] = []
        stuck: list[Sequence] = []
        candidates = deque(self.running)
        while candidates:
            seq = candidates.popleft()
            needs_block = len(seq.block_table) < blocks_for(seq.num_tokens, self.block_size)
            while needs_block and self.blocks.num_free == 0 and candidates:
                self.preempt(candidates.pop())
            if needs_block and self.blocks.num_free == 0:
                if scheduled:
                    self.preempt(seq)
                else:
                    stuck.append(seq)
                continue
            if needs_block:
                seq.block_table += self.blocks.allocate(1)
            scheduled.append(seq)
        return scheduled, stuck

    def preempt(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table + seq.reserved_blocks)
        seq.block_table, seq.reserved_blocks = [], []
        seq.num_cached = 0
        seq.prefilled = False
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        """Release a sequence's blocks; it leaves the running set or the queue."""
        self.blocks.release(seq.block_table + seq.reserved_blocks)
        seq.block_table, seq.reserved_blocks = [], []
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
