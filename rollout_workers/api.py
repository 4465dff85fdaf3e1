"""The contract every rollout backend (native engine, vLLM) implements, and the data it returns."""

import asyncio
import contextlib
import math
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from sparrow.layout import SparseAttentionConfig
from sparrow.schedule import SparsitySchedule


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. Logprobs always come from the fp32, temperature-scaled, *unfiltered*
    log-softmax (what the trainer recomputes), whatever top-p / top-k do to sampling."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 20

    def validate(self) -> None:
        """Raise ValueError naming the field, the value and the allowed range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r}: must be an integer >= 1")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r}: must be a finite number >= 0 (0 = greedy)")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r}: must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r}: must be an integer >= 0 (0 = off)")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n={self.n!r}: must be an integer >= 1")
        if not isinstance(self.logprobs, int) or self.logprobs < 0:
            raise ValueError(f"logprobs={self.logprobs!r}: must be an integer >= 0")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}: must be an integer or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class RolloutRequest:
    """One prompt; `sampling.n` samples are drawn from it (a GRPO group shares its prompt blocks)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    prompt_text: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass
class RolloutSample:
    """One finished sample. Per generated token t:

    - `token_ids[t]`, `logprobs[t]` (log q of the sampled token),
    - `top_ids[t, :]`, `top_logprobs[t, :]` (the K most likely tokens under q, descending),
    - `blocks_attended[t]`: KV blocks per KV head attended in the sparse layers by the forward pass
      that produced token t (its whole context when that pass was dense).

    `finish_reason` is "stop" (EOS or a stop id), "length" (max_tokens or the model's maximum
    length), "interrupted" (`RolloutEngine.interrupt`: the tokens so far, to be resumed) or "error"
    (then `error` says why and the tensors are empty).
    """

    request_id: str
    sample_index: int
    prompt_token_ids: list[int]
    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    blocks_attended: torch.Tensor
    finish_reason: str
    policy_version: int
    schedule_version: int
    error: str | None = None
    metadata: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def failed(cls, request: RolloutRequest, sample_index: int, error: str, policy_version: int, schedule_version: int):
        return cls.empty(request, sample_index, "error", policy_version, schedule_version, error)

    @classmethod
    def empty(cls, request: RolloutRequest, sample_index: int, finish_reason: str, policy_version: int,
              schedule_version: int, error: str | None = None):
        """A sample that generated nothing: failed, or interrupted before its first token."""
        empty = torch.zeros(0)
        return cls(
            request_id=request.request_id, sample_index=sample_index, prompt_token_ids=list(request.prompt_token_ids),
            token_ids=empty.long(), logprobs=empty, top_ids=empty.long().view(0, 0), top_logprobs=empty.view(0, 0),
            blocks_attended=empty.int(), finish_reason=finish_reason, policy_version=policy_version,
            schedule_version=schedule_version, error=error, metadata=dict(request.metadata),
        )


@dataclass
class TeacherForcedOutput:
    """Log-probabilities of given generated tokens, recomputed teacher-forced."""

    logprobs: torch.Tensor
    """`[G]` log q of each generated token."""
    blocks_attended: torch.Tensor
    """`[G]` blocks per KV head the producing query attended in the sparse layers."""
    full_logprobs: torch.Tensor | None
    """`[G, V]` the whole log-distribution per generated token (when asked for)."""


class PromptScorer(Protocol):
    """Teacher-forced recomputes of samples that share one prompt (the prompt is encoded once)."""

    quantized_kv: bool
    """The engine's rollouts read K/V from FP8 pages: a replay (`blocks_attended` given) rounds K/V as they did, so
    it differs from the dense recompute even where no pass was sparse."""

    def logprobs(self, generated: torch.Tensor, blocks_attended: torch.Tensor | None = None) -> TeacherForcedOutput:
        """Full-vocabulary log-probabilities of `generated` after the prompt: dense, or with the sparse
        attention a sample was decoded with replayed from its `blocks_attended`."""


WeightsSource = Mapping[str, torch.Tensor] | str | Path

ABORTED = "aborted"
"""The `error` of a sample ended by `RolloutEngine.abort`."""

INTERRUPTED = "interrupted"
"""The `finish_reason` of a sample ended by `RolloutEngine.interrupt`, its tokens kept."""


@dataclass(frozen=True)
class EngineCounters:
    """Counts since the engine started, cheap to read from any thread while a call runs."""

    tokens_generated: int
    samples_finished: int
    samples_failed: int
    samples_running: int
    """Samples accepted and not finished yet."""


class RequestFeed:
    """Requests for a `stream` that is already running: `put` them from any thread while it runs, and
    `close()` when no more will come. The stream admits each request as it arrives and ends once the
    feed is closed and every admitted sample has finished.

    Consumers (the engines) `take()` what has arrived, or iterate with `async for`, which waits for the
    next request without blocking their event loop (any loop, in any thread).
    """

    def __init__(self, requests: Iterable[RolloutRequest] = ()):
        self._lock = threading.Lock()
        self._pending: deque[RolloutRequest] = deque(requests)
        self._closed = False
        self._wakeups: list[Callable[[], None]] = []

    @classmethod
    def of(cls, requests: "Sequence[RolloutRequest] | RequestFeed") -> "RequestFeed":
        """`requests` if it is a feed, else a closed feed holding them."""
        if isinstance(requests, RequestFeed):
            return requests
        feed = cls(requests)
        feed.close()
        return feed

    def put(self, request: RolloutRequest) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"put({request.request_id!r}) after close(): the feed takes no more requests")
            self._pending.append(request)
        self._wake()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._wake()

    @property
    def exhausted(self) -> bool:
        """Closed, and every request taken."""
        with self._lock:
            return self._closed and not self._pending

    def __len__(self) -> int:
        """Requests put and not taken yet."""
        return len(self._pending)

    def withdraw(self, request_id: str) -> list[RolloutRequest]:
        """Remove the requests with this id that were put and not taken yet (an engine aborting them)."""
        with self._lock:
            withdrawn = [r for r in self._pending if r.request_id == request_id]
            for request in withdrawn:
                self._pending.remove(request)
        return withdrawn

    def take(self) -> list[RolloutRequest]:
        """Every request that has arrived and was not taken yet (without waiting)."""
        with self._lock:
            taken = list(self._pending)
            self._pending.clear()
        return taken

    async def wait(self) -> None:
        """Return once a request is waiting or the feed is closed."""
        loop = asyncio.get_running_loop()
        arrived = asyncio.Event()
        with self._lock:
            if self._pending or self._closed:
                return
            self._wakeups.append(lambda: loop.call_soon_threadsafe(arrived.set))
        await arrived.wait()

    def __aiter__(self) -> AsyncIterator[RolloutRequest]:
        return self._arrivals()

    async def _arrivals(self) -> AsyncIterator[RolloutRequest]:
        while True:
            for request in self.take():
                yield request
            if self.exhausted:
                return
            await self.wait()

    def _wake(self) -> None:
        with self._lock:
            wakeups, self._wakeups = self._wakeups, []
        for wake in wakeups:
            with contextlib.suppress(RuntimeError):  # the waiting loop has closed: nobody waits any more
                wake()


@dataclass(frozen=True)
class MemoryTransition:
    """One `sleep` or `wake` of an engine: how long it took and the device bytes it gave back or took."""

    seconds: float
    bytes: int


def _check_version(version) -> None:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"version={version!r}: must be an integer >= 0")


class RolloutEngine(ABC):
    """A rollout backend. A bad request yields a sample with finish_reason "error" and leaves the
    other requests of the call untouched; only engine-wide failures raise.

    The base keeps what every backend shares: the sparse `layout` its schedules must fit, the policy
    and schedule versions, the refusal of new weights while samples are in flight, the rule of one
    `generate` / `stream` call at a time (`_serving_call`), and one weight or schedule change at a time
    (`_changing`): a backend may restart itself to take new weights (vLLM on CPU), and a schedule change
    sent to the engine it is stopping would wait for an answer forever. Backends implement the hooks below.
    """

    def __init__(self, layout: SparseAttentionConfig):
        self.layout = layout
        self._policy_version = 0
        self._schedule: SparsitySchedule | None = None
        self._serving = threading.Lock()
        self._changing = threading.Lock()
        self.asleep = False
        """The KV cache's memory is given back (`sleep`); calls are refused until `wake`."""

    # ------------------------------------------------------------------ requests

    @abstractmethod
    def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutSample]:
        """All samples of all requests, in request order then sample order."""

    @abstractmethod
    def stream(self, requests: "Sequence[RolloutRequest] | RequestFeed") -> AsyncIterator[RolloutSample]:
        """The same samples, each yielded as soon as it finishes. Given a `RequestFeed`, requests put into it
        while the stream runs are admitted between steps; the stream ends when the feed is closed and every
        admitted sample has finished. Closing the stream early drops (and frees) what is unfinished."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """End the request's unfinished samples, from any thread: each comes out of the running call (or the
        next `step`) with finish_reason "error" and error "aborted", its KV blocks freed. Samples that already
        finished are unaffected; an unknown request id is ignored."""

    def interrupt(self, request_id: str) -> None:
        """End the request's unfinished samples keeping what they generated, from any thread (a partial rollout
        resumes them later, under the weights in force then): each comes out of the running call with
        finish_reason "interrupted", its tokens so far (none for a sample not started) and its KV blocks freed.
        Samples that already finished are unaffected; an unknown request id is ignored. Engines whose config
        says `interrupts` implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot interrupt a sample and keep its tokens")

    # ------------------------------------------------------------------ weights and schedule

    def load_weights(self, weights: WeightsSource, version: int) -> None:
        """Replace the policy weights (a state dict or an HF directory) and set their version; refused while
        samples are in flight. On any error the old weights and version stay. A `set_schedule` from another
        thread meanwhile waits until the new weights are in place."""
        _check_version(version)
        in_flight = self.counters().samples_running
        if in_flight:
            raise RuntimeError(f"load_weights with {in_flight} samples in flight; call it between generate() calls")
        with self._changing:
            self._load_weights(weights, version)
            self._policy_version = version

    def check_schedule(self, schedule: SparsitySchedule | None) -> None:
        """Raise `ScheduleError` unless `schedule` counts blocks of this engine's layout."""
        self.layout.check_compatible(schedule)

    def set_schedule(self, schedule: SparsitySchedule | None) -> None:
        """Use `schedule` from the next decode step on (None = dense); from any thread, also while a call runs
        (`schedule` reports it once it is in force), after a weight change in progress."""
        self.check_schedule(schedule)
        with self._changing:
            self._set_schedule(schedule)

    @property
    def policy_version(self) -> int:
        return self._policy_version

    @property
    def schedule(self) -> SparsitySchedule | None:
        return self._schedule

    @property
    def schedule_version(self) -> int:
        """The active schedule's version; -1 while rollouts are dense."""
        schedule = self.schedule
        return -1 if schedule is None else schedule.version

    @property
    @abstractmethod
    def max_concurrent_samples(self) -> int:
        """Samples decoded together at most (a group of n counts n); more wait inside the engine."""

    # ------------------------------------------------------------------ device memory (colocated placement)

    def sleep(self) -> MemoryTransition:
        """Give the KV cache's device memory back between calls, for a trainer on the same GPU (the colocated
        placement); the weights stay, so new versions load while asleep. Refused while samples are in flight."""
        if self.asleep:
            return MemoryTransition(0.0, 0)
        in_flight = self.counters().samples_running
        if in_flight:
            raise RuntimeError(f"sleep with {in_flight} samples in flight; call it between generate() calls")
        with self._serving_call(), self._changing:
            start = time.perf_counter()
            freed = self._sleep()
            self.asleep = True
            return MemoryTransition(time.perf_counter() - start, freed)

    def wake(self) -> MemoryTransition:
        """Take the KV cache's memory again (and whatever else `sleep` let go) before the next call."""
        with self._changing:
            if not self.asleep:
                return MemoryTransition(0.0, 0)
            start = time.perf_counter()
            taken = self._wake()
            self.asleep = False
            return MemoryTransition(time.perf_counter() - start, taken)

    def _sleep(self) -> int:
        """Free the KV cache (the engine is idle); returns the bytes freed."""
        raise NotImplementedError(f"{type(self).__name__} cannot give its device memory back between calls; "
                                  "run it with run.placement: disaggregated")

    def _wake(self) -> int:
        """Allocate what `_sleep` freed; returns the bytes taken."""
        raise NotImplementedError(f"{type(self).__name__} cannot give its device memory back between calls")

    # ------------------------------------------------------------------ introspection and lifetime

    @abstractmethod
    def counters(self) -> EngineCounters: ...

    @abstractmethod
    def stats(self) -> dict:
        """Counters for metrics: tokens generated, throughput, cache use, preemptions, versions."""

    def prompt_scorer(self, prompt_token_ids: Sequence[int], temperature: float = 1.0) -> PromptScorer:
        """Teacher-forced recomputes with this engine's model and layout (logprobs of logits / temperature),
        what calibration measures α with."""
        raise NotImplementedError(
            f"{type(self).__name__} cannot recompute logprobs teacher-forced; prompt_scorer() needs the native engine"
        )

    def parameters(self, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """CPU copies of the served weights by HF name (for checks and debugging)."""
        raise NotImplementedError(f"{type(self).__name__} does not expose its weights; parameters() needs the native engine")

    def shutdown(self) -> None:
        """Release the engine's processes and memory; it is unusable afterwards. Default: nothing to release."""

    # ------------------------------------------------------------------ for backends

    @contextlib.contextmanager
    def _serving_call(self):
        """Hold for one generate/stream call: a second one at the same time is refused, and so is one while asleep."""
        if self.asleep:
            raise RuntimeError(f"{type(self).__name__} is asleep (its KV cache is given back); wake() it first")
        if not self._serving.acquire(blocking=False):
            raise RuntimeError("the engine is already serving a generate/stream call; run them one at a time")
        try:
            yield
        finally:
            self._serving.release()

    @abstractmethod
    def _load_weights(self, weights: WeightsSource, version: int) -> None:
        """Put validated new weights in place (nothing is in flight)."""

    @abstractmethod
    def _set_schedule(self, schedule: SparsitySchedule | None) -> None:
        """Put a checked schedule in force and set `self._schedule` when it takes effect."""
