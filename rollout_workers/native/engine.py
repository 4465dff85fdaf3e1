"""`NativeEngine`: Sparrow's own rollout engine — the loop.

Requests come in (`add_request`), steps run (`step`), finished samples go out. Each step asks the
`Scheduler` which sequences run (a prefill step: new prompts, chunks of long prompts, recomputation
of preempted sequences; or a decode step over every running sequence), has the `ModelRunner` run
them as one forward pass and draw their next tokens, and lets the scheduler apply the stop rules.
With `overlap_decode`, a decode step is launched before the previous one's tokens are read (`_InFlight`).
See docs/native_engine.md for the cache layout, the allocator and how blocks attended are counted.
"""

import asyncio
import contextlib
import random
import threading
import time
from collections.abc import AsyncIterator, Sequence as Seq
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import distributed as dist
from tqdm import tqdm

from sparrow.rollout_workers.api import (
    ABORTED, INTERRUPTED, EngineCounters, RequestFeed, RolloutEngine, RolloutRequest, RolloutSample, TeacherForcedOutput,
    WeightsSource,
)
from sparrow.schedule import SparsitySchedule, load_schedule

from .block_manager import BlockManager
from .config import NativeEngineConfig
from .model import DecoderModel
from .model_runner import ModelRunner
from .prompt_recompute import PromptRecompute
from .scheduler import PrefillChunk, Scheduler
from .sequence import Draws, PendingDraws, Sequence
from .teacher_forced import teacher_forced_logprobs
from .transfer import to_device

Finished = list[tuple[RolloutRequest, RolloutSample]]


@dataclass
class _InFlight:
    """A decode step launched whose tokens have not been read yet (`overlap_decode`)."""

    seqs: list[Sequence]
    draws: PendingDraws
    schedule_version: int


class NativeEngine(RolloutEngine):
    """Rollouts on CPU or CUDA from an HF directory (`NativeEngineConfig.model`) or a built model.

    One `generate` or `stream` at a time; weights change between them. While one runs, other threads may
    put requests into its `RequestFeed`, `abort` requests, `set_schedule` (in force from the next step)
    and read `counters()`.

    With `tensor_parallel_size` > 1, each rank's process builds its own engine over `process_group` (default:
    the default group) and the ranks run in lockstep: each must get the same calls (requests, schedules,
    weights) in the same order, and each returns the same samples (tensor_parallel.py says why).
    """

    def __init__(self, config: NativeEngineConfig, model: DecoderModel | None = None,
                 process_group: dist.ProcessGroup | None = None):
        self.config = config
        self.runner = ModelRunner(config, model, process_group)
        super().__init__(self.runner.layout)
        spec = self.runner.spec
        self.scheduler = Scheduler(
            BlockManager(self.runner.num_kv_blocks, on_allocate=self.runner.mark_allocated), self.layout,
            config.max_num_seqs, config.prefill_chunk_size, self.runner.max_model_len, spec.vocab_size, spec.eos_token_ids,
        )
        self._rng = random.Random(config.seed)
        self._samples_running = 0
        """Samples of accepted requests that have not finished (a group leader counts its n samples)."""
        self._stepping = threading.Lock()
        """Held by a step; whatever changes engine state from another thread (a schedule) or drops
        sequences (the end of a call) waits for it."""
        self._feed: RequestFeed | None = None
        """The running stream's feed."""
        self._aborts: dict[str, str] = {}
        """Request ids to end before the next step: ABORTED (`abort`) or INTERRUPTED (`interrupt`)."""
        self._withdrawn: list[tuple[RolloutRequest, str]] = []
        """Requests aborted or interrupted while still in the feed, before the loop admitted them."""
        self._aborts_lock = threading.Lock()
        self._counters = dict.fromkeys(
            ("tokens_generated", "prefill_tokens", "decode_tokens", "prefill_steps", "decode_steps",
             "decode_steps_overlapped", "decode_rows_discarded", "samples_finished", "samples_failed"), 0)
        self._seconds = {"prefill": 0.0, "decode": 0.0}
        self._step_end = 0.0
        """When the last step returned: with a step left in flight the GPU worked on from then on, so the next step's
        time counts from it (the busy clock is the wall clock with work on the device, not the host's time in steps)."""
        self._inflight: _InFlight | None = None
        if config.schedule:
            self.set_schedule(load_schedule(config.schedule))

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, process_group: dist.ProcessGroup | None = None,
                        **overrides) -> "NativeEngine":
        return cls(NativeEngineConfig(model=str(model_dir), **overrides), process_group=process_group)

    def capture_decode_graphs(self, batch_sizes, max_len: int | None = None) -> int:
        """Capture the decode graphs for these batch sizes at every block-table width up to `max_len` tokens
        (default max_model_len), dense and sparse, so no capture happens mid-generation; returns how many
        graphs the engine holds. Without this, each graph is captured the first time a step needs it."""
        return self.runner.capture_decode_graphs(batch_sizes, max_len)

    # ------------------------------------------------------------------ RolloutEngine contract

    @property
    def max_concurrent_samples(self) -> int:
        return self.config.max_num_seqs

    def _set_schedule(self, schedule: SparsitySchedule | None) -> None:
        with self._stepping:  # a step in flight (another thread) finishes under the old schedule
            self._schedule = schedule
            self.runner.set_schedule(schedule)

    def _load_weights(self, weights: WeightsSource, version: int) -> None:
        """Validate all tensors first, then copy in place."""
        self.runner.load_weights(weights)

    def parameters(self, names: Seq[str]) -> dict[str, torch.Tensor]:
        return self.runner.parameters(list(names))

    def _sleep(self) -> int:
        with self._stepping:
            return self.runner.release_memory()

    def _wake(self) -> int:
        with self._stepping:
            return self.runner.restore_memory()

    def prompt_scorer(self, prompt_token_ids: Seq[int], temperature: float = 1.0) -> PromptRecompute:
        return PromptRecompute(self.runner.model, prompt_token_ids, self.layout, temperature,
                               quantized_kv=self.config.kv_cache_dtype != "auto")

    def counters(self) -> EngineCounters:
        c = self._counters
        return EngineCounters(c["tokens_generated"], c["samples_finished"], c["samples_failed"], self._samples_running)

    def generate(self, requests: Seq[RolloutRequest], progress: bool = False) -> list[RolloutSample]:
        """`progress` shows a bar of tokens (at most max_tokens per sample; a sample that stops early
        is counted in full when it finishes), which moves even while all samples are still running."""
        order = {id(r): i for i, r in enumerate(requests)}
        results: Finished = []
        budget = sum(_num_samples(r) * r.sampling.max_tokens for r in requests)
        with self._session(), tqdm(total=budget, disable=not progress, desc="generate", unit="tok") as bar:
            for request in requests:
                results += [(request, s) for s in self.add_request(request)]
            while self.has_unfinished():
                before = self._counters["tokens_generated"]
                finished = self._abort_then_step()
                unused = sum(r.sampling.max_tokens - len(s.token_ids) for r, s in finished)
                bar.update(self._counters["tokens_generated"] - before + unused)
                results += finished
        results.sort(key=lambda pair: (order[id(pair[0])], pair[1].sample_index))
        return [s for _, s in results]

    async def stream(self, requests: Seq[RolloutRequest] | RequestFeed) -> AsyncIterator[RolloutSample]:
        """Between steps: the aborts asked for, then what the feed brought, then one step in a worker thread.
        An aborted request still in the feed is withdrawn from it; one already taken is in the scheduler."""
        feed = RequestFeed.of(requests)
        with self._session(feed):
            while True:
                aborts, withdrawn = self._take_aborts()
                for request, reason in withdrawn:
                    for j in range(_num_samples(request)):
                        yield self._unstarted(request, j, reason)
                for request in feed.take():
                    for failed in self.add_request(request):
                        yield failed
                for _, sample in self._abort(aborts):
                    yield sample
                if self.has_unfinished():
                    for _, done in await asyncio.to_thread(self._step):
                        yield done
                elif self._drained(feed):
                    return
                else:
                    await feed.wait()

    def abort(self, request_id: str) -> None:
        self._end(request_id, ABORTED)

    def interrupt(self, request_id: str) -> None:
        self._end(request_id, INTERRUPTED)

    def _end(self, request_id: str, reason: str) -> None:
        with self._aborts_lock:
            self._aborts.setdefault(request_id, reason)
            if self._feed is not None:
                self._withdrawn += [(r, reason) for r in self._feed.withdraw(request_id)]

    def stats(self) -> dict:
        c, busy = self._counters, sum(self._seconds.values())
        blocks = self.scheduler.blocks
        return {
            **c,
            "tokens_per_s": c["tokens_generated"] / busy if busy else 0.0,
            "decode_tokens_per_s": c["decode_tokens"] / self._seconds["decode"] if self._seconds["decode"] else 0.0,
            "busy_seconds": busy,
            "prefill_seconds": self._seconds["prefill"],
            "decode_seconds": self._seconds["decode"],
            "kv_blocks_used": blocks.num_used,
            "kv_blocks_free": blocks.num_free,
            "kv_blocks_shared": blocks.num_shared,
            "prefix_blocks_saved": blocks.blocks_saved_by_sharing,
            "preemptions": self.scheduler.num_preemptions,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "policy_version": self._policy_version,
            "schedule_version": self.schedule_version,
            "schedule": None if self._schedule is None else self._schedule.name,
            "samples_running": self._samples_running,
            **self.runner.stats(),
        }

    def teacher_forced_logprobs(self, token_ids, prompt_len: int, schedule: SparsitySchedule | None = None,
                                temperature: float = 1.0, full: bool = False) -> TeacherForcedOutput:
        """`teacher_forced_logprobs` with this engine's model and attention settings."""
        return teacher_forced_logprobs(self.runner.model, token_ids, prompt_len, schedule, self.layout, temperature, full)

    # ------------------------------------------------------------------ requests and steps

    @contextlib.contextmanager
    def _session(self, feed: RequestFeed | None = None):
        """One generate/stream call; whatever it leaves unfinished (a stream closed early) is dropped, and
        aborts asked for after it refer to nothing."""
        with self._serving_call():
            self._feed = feed
            try:
                yield
            finally:
                self._drop_unfinished()
                with self._aborts_lock:
                    self._feed, self._aborts, self._withdrawn = None, {}, []

    def _drop_unfinished(self) -> None:
        with self._stepping:  # a cancelled stream's step may still run in its thread
            self._inflight = None
            for seq in self.scheduler.unfinished():
                self._finish(seq)

    def drop_unfinished(self) -> None:
        """Drop every unfinished sequence without returning its samples; for callers driving `step`."""
        if self._serving.locked():
            raise RuntimeError("drop_unfinished() while a generate/stream call runs; close the stream instead")
        self._drop_unfinished()

    def _drained(self, feed: RequestFeed) -> bool:
        """The feed is closed and empty, and no request withdrawn from it waits to be reported."""
        with self._aborts_lock:
            return feed.exhausted and not self._withdrawn

    def _take_aborts(self) -> tuple[dict[str, str], list[tuple[RolloutRequest, str]]]:
        with self._aborts_lock:
            aborts, self._aborts = self._aborts, {}
            withdrawn, self._withdrawn = self._withdrawn, []
        return aborts, withdrawn

    def _abort(self, requests: dict[str, str]) -> Finished:
        """End the unfinished samples of these requests (their blocks are released): failed ("error"), or with
        their tokens so far (INTERRUPTED)."""
        finished: Finished = []
        for request_id, reason in requests.items():
            for seq in self.scheduler.unfinished(request_id):
                finished += self._fail(seq, ABORTED) if reason == ABORTED else self._interrupt(seq)
        return finished

    def _interrupt(self, seq: Sequence) -> Finished:
        """A leader that has not forked has generated nothing: each of its samples comes out empty."""
        self._finish(seq)
        if seq.fork_into > 1:
            return [(seq.request, self._unstarted(seq.request, j, INTERRUPTED)) for j in range(seq.fork_into)]
        seq.finish_reason = INTERRUPTED
        return [(seq.request, seq.to_sample(self._policy_version))]

    def _unstarted(self, request: RolloutRequest, index: int, reason: str) -> RolloutSample:
        if reason == ABORTED:
            return self._failed(request, index, ABORTED)
        return RolloutSample.empty(request, index, INTERRUPTED, self._policy_version, self.schedule_version)

    def add_request(self, request: RolloutRequest) -> list[RolloutSample]:
        """Queue a request's samples; returns them at once as errors if the request is invalid."""
        try:
            self.scheduler.check(request)
        except ValueError as exc:
            return [self._failed(request, j, str(exc)) for j in range(_num_samples(request))]
        seed = request.sampling.seed
        self.scheduler.add(request, seed if seed is not None else self._rng.getrandbits(63))
        self._samples_running += request.sampling.n
        return []

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def step(self) -> list[RolloutSample]:
        """Apply the aborts asked for since the last step, run one prefill or decode step; returns the
        samples that ended."""
        return [s for _, s in self._abort_then_step()]

    def _abort_then_step(self) -> Finished:
        finished = self._abort(self._take_aborts()[0])
        if self.has_unfinished():
            finished += self._step()
        return finished

    def _step(self) -> Finished:
        with self._stepping:
            return self._run_step()

    @torch.inference_mode()
    def _run_step(self) -> Finished:
        start = time.perf_counter() if self._inflight is None else self._step_end
        if self._inflight is not None:
            finished, phase = self._continue_decode(), "decode"
        else:
            finished, phase = self._new_step()
        if self._inflight is None:  # with a step in flight the host goes on: that is the overlap
            self.runner.synchronize()
        self._step_end = time.perf_counter()
        self._seconds[phase] += self._step_end - start
        return finished

    def _new_step(self) -> tuple[Finished, str]:
        """A prefill step if any sequence needs one, else a decode step over the running sequences."""
        finished: Finished = []
        chunks, impossible = self.scheduler.schedule_prefill()
        for seq in impossible:
            finished += self._fail(seq, "the KV cache cannot hold this sequence even alone; raise num_kv_blocks")
        if chunks:
            return finished + self._prefill(chunks), "prefill"
        batch = self.scheduler.schedule_decode()
        for seq in batch.preempted:
            self.runner.release_row(seq)
        for seq in batch.stuck:
            finished += self._fail(seq, f"KV cache exhausted at {seq.num_tokens} tokens with no sequence left to "
                                        f"preempt (pool of {self.runner.num_kv_blocks} blocks); raise num_kv_blocks")
        if batch.seqs:
            finished += self._decode(batch.seqs)
        return finished, "decode"

    def _prefill(self, chunks: list[PrefillChunk]) -> Finished:
        completed, logits = self.runner.prefill(chunks)
        self._counters["prefill_tokens"] += sum(ch.end - ch.start for ch in chunks)
        self._counters["prefill_steps"] += 1
        if not completed:
            return []
        seqs, rows = [], []
        for i, leader in enumerate(completed):
            group = self._fork(leader) if leader.fork_into > 1 else [leader]
            seqs += group
            rows += [i] * len(group)
        return self._record(seqs, self.runner.first_tokens(seqs, logits[rows]), self.schedule_version)

    def _fork(self, leader: Sequence) -> list[Sequence]:
        """A group leader whose prompt is cached becomes its n samples (scheduler), and its partial last
        prompt block is copied into each extra sample's block (runner)."""
        group, sources, copies = self.scheduler.fork(leader)
        if sources:
            self.runner.copy_blocks(sources, copies)
        return group

    def _decode(self, seqs: list[Sequence]) -> Finished:
        self._counters["decode_steps"] += 1
        if self.config.overlap_decode:
            self._inflight = _InFlight(seqs, self.runner.launch_decode(seqs), self.schedule_version)
            return []
        draws = self.runner.decode(seqs)
        self._counters["decode_tokens"] += len(seqs)
        return self._record(seqs, draws, self.schedule_version)

    def _continue_decode(self) -> Finished:
        """Launch the next decode step, fed with the tokens of the one in flight, then read those tokens and
        apply the stop rules: the host's work overlaps the GPU's next step. A sequence that stops at a stop
        token has a row in the next step too; that row is discarded."""
        prev, self._inflight = self._inflight, None
        chained = self._chain(prev)
        if chained:
            row = {seq: i for i, seq in enumerate(prev.seqs)}
            fed = prev.draws.device_tokens[to_device([row[s] for s in chained], self.runner.device)]
            self._inflight = _InFlight(chained, self.runner.launch_decode(chained, fed), self.schedule_version)
            self._counters["decode_steps"] += 1
            self._counters["decode_steps_overlapped"] += 1
        draws = prev.draws.resolve()
        running = set(self.scheduler.running)
        live = [(i, seq) for i, seq in enumerate(prev.seqs) if seq in running]  # not aborted or stopped since
        self._counters["decode_tokens"] += len(live)
        self._counters["decode_rows_discarded"] += len(prev.seqs) - len(live)
        return self._record([seq for _, seq in live], draws, prev.schedule_version, [i for i, _ in live])

    def _chain(self, prev: _InFlight) -> list[Sequence]:
        """The sequences of the step after `prev` when it is a plain continuation: no prompt waits for a
        prefill, and blocks are free for every sequence that goes on; otherwise none (the step in flight is
        read first, and the next one is scheduled as usual, with preemptions if needed)."""
        scheduler = self.scheduler
        if scheduler.waiting or any(not seq.prefilled for seq in scheduler.running):
            return []
        running = set(scheduler.running)
        chained = [seq for seq in prev.seqs if seq in running and scheduler.runs_past_next(seq)]
        if not chained or not scheduler.reserve_next(chained):
            return []
        return chained

    def _record(self, seqs: list[Sequence], draws: Draws, schedule_version: int,
                rows: list[int] | None = None) -> Finished:
        """Hand the drawn tokens (of `rows` of the step's batch; default all, in order) to the scheduler; the
        samples that ended come back finished."""
        rows = list(range(len(seqs))) if rows is None else rows
        finished: Finished = []
        for seq, error in self.scheduler.postprocess(seqs, draws, schedule_version, rows):
            if error is not None:
                finished += self._fail(seq, error)
                continue
            self._finish(seq)
            self._counters["samples_finished"] += 1
            finished.append((seq.request, seq.to_sample(self._policy_version)))
        self._counters["tokens_generated"] += sum(draws.finite[r] for r in rows)
        return finished

    def _finish(self, seq: Sequence) -> None:
        """The sequence leaves (stopped, failed or dropped): its blocks and graph row are released, and its
        samples (n for a group leader that has not forked) no longer run."""
        self.scheduler.finish(seq)
        self.runner.release_row(seq)
        self._samples_running -= seq.fork_into

    def _fail(self, seq: Sequence, error: str) -> Finished:
        """Fail one sample, or every sample of a group leader that has not forked yet."""
        self._finish(seq)
        indices = range(seq.fork_into) if seq.fork_into > 1 else [seq.sample_index]
        return [(seq.request, self._failed(seq.request, j, error)) for j in indices]

    def _failed(self, request: RolloutRequest, index: int, error: str) -> RolloutSample:
        self._counters["samples_failed"] += 1
        return RolloutSample.failed(request, index, error, self._policy_version, self.schedule_version)


def _num_samples(request: RolloutRequest) -> int:
    n = request.sampling.n
    return n if isinstance(n, int) and n > 0 else 1
