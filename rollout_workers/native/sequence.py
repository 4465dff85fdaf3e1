"""One sample in flight: its tokens, its KV blocks, and what it has produced so far."""

from dataclasses import dataclass, field

import numpy as np
import torch

from sparrow.rollout_workers.api import RolloutRequest, RolloutSample
from sparrow.schedule import DENSE_BUDGET

from .sampler import SampleOutput


@dataclass
class Draws:
    """One step's draws for a batch of sequences, on the host: the tokens and whether each row's logits were finite,
    and what a sample keeps per token, packed by type (the device copy of the tokens, which feeds the next step, stays
    with `PendingDraws`)."""

    tokens: list[int]
    finite: list[int]
    floats: np.ndarray
    """`[R, 1 + K]` float32: the sampled token's logprob, then the top-K logprobs."""
    ints: np.ndarray
    """`[R, 1 + K]` int64: blocks attended, then the top-K token ids."""


class PendingDraws:
    """A step's draws on their way to the host: tokens, finiteness flags, logprobs, top-k lists and blocks attended
    are packed into two tensors (one per type) and copied into pinned memory without waiting, so the host can launch
    the next step before reading them (`resolve`). A sample's per-token record is then written on the host while the
    GPU runs the next step, instead of gathered from every step's device tensors when the sample ends (that gather,
    ~15 us a token, made the last step of a 24-sample 32K rollout of the 8B shape on an H200 take 12-16 s)."""

    def __init__(self, device_tokens: torch.Tensor, floats: torch.Tensor, ints: torch.Tensor, ready):
        self.device_tokens = device_tokens  # what an overlapped next step is fed, without waiting for the host
        self._floats, self._ints, self._ready = floats, ints, ready

    @classmethod
    def launch(cls, output: SampleOutput, blocks: torch.Tensor) -> "PendingDraws":
        floats = torch.cat([output.logprobs[:, None], output.top_logprobs], dim=1)
        ints = torch.cat([output.tokens[:, None], output.finite[:, None].long(), blocks[:, None].long(),
                          output.top_ids.long()], dim=1)
        if floats.device.type != "cuda":
            return cls(output.tokens, floats, ints, None)
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (floats, ints)]
        for dst, src in zip(host, (floats, ints)):
            dst.copy_(src, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(output.tokens, *host, ready)

    def resolve(self) -> Draws:
        """Wait for the copies; the draws on the host."""
        if self._ready is not None:
            self._ready.synchronize()
        ints = self._ints.numpy()
        return Draws(ints[:, 0].tolist(), ints[:, 1].tolist(), self._floats.numpy(), ints[:, 2:])


class TokenHistory:
    """What a sample keeps per generated token (its logprob, top-k lists and blocks attended) in host arrays that
    grow by doubling up to `max_tokens` rows: one row written per token as its step is read, one copy out when the
    sample ends."""

    def __init__(self, num_logprobs: int, max_tokens: int):
        self.k, self.n, self.max_tokens = num_logprobs, 0, max_tokens
        self.floats = np.empty((0, 1 + num_logprobs), np.float32)
        self.ints = np.empty((0, 1 + num_logprobs), np.int64)

    def append(self, draws: Draws, row: int) -> None:
        if self.n == len(self.floats):
            rows = max(self.n + 1, min(max(64, 2 * self.n), self.max_tokens))
            self.floats, self.ints = (_grown(a, rows) for a in (self.floats, self.ints))
        self.floats[self.n] = draws.floats[row, : 1 + self.k]
        self.ints[self.n] = draws.ints[row, : 1 + self.k]
        self.n += 1

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(logprobs [n], top_ids [n, k], top_logprobs [n, k], blocks_attended [n] int32), each its own copy."""
        floats, ints = torch.from_numpy(self.floats[: self.n]), torch.from_numpy(self.ints[: self.n])
        return (floats[:, 0].clone(), ints[:, 1:].clone(), floats[:, 1:].clone(), ints[:, 0].to(torch.int32))


def _grown(a: np.ndarray, rows: int) -> np.ndarray:
    out = np.empty((rows, *a.shape[1:]), a.dtype)
    out[: len(a)] = a
    return out


@dataclass(eq=False)
class Sequence:
    """Positions `< prompt_len` are the prompt. Every forward pass whose query sits at a position
    `p ≥ prompt_len` used a KV budget, kept in `budgets[p - prompt_len]`, so a preempted sequence
    recomputes its cache with exactly the attention it was decoded with.

    A group leader (`fork_into = n > 1`) computes the shared prompt once and then becomes sample 0
    of n samples that share its full prompt blocks.
    """

    request: RolloutRequest
    sample_index: int
    seed: int
    token_ids: list[int]
    prompt_len: int
    fork_into: int = 1
    seed_base: int = 0
    num_cached: int = 0
    prefilled: bool = False
    block_table: list[int] = field(default_factory=list)
    reserved_blocks: list[int] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)
    schedule_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    history: TokenHistory = field(init=False)

    def __post_init__(self):
        self.history = TokenHistory(self.sampling.logprobs, self.sampling.max_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def sampling(self):
        return self.request.sampling

    def query_budgets(self, start: int, end: int, last_budget: int) -> list[int]:
        """KV budget of the queries at positions [start, end); the newest position takes `last_budget`."""
        out = []
        for p in range(start, end):
            if p < self.prompt_len:
                out.append(DENSE_BUDGET)
            elif p - self.prompt_len < len(self.budgets):
                out.append(self.budgets[p - self.prompt_len])
            else:
                out.append(last_budget)
        return out

    def record(self, draws: Draws, row: int, schedule_version: int) -> None:
        """Append the token drawn for this sequence at `row` of a step's batch."""
        self.token_ids.append(draws.tokens[row])
        self.history.append(draws, row)
        if not self.schedule_versions or self.schedule_versions[-1] != schedule_version:
            self.schedule_versions.append(schedule_version)

    def to_sample(self, policy_version: int) -> RolloutSample:
        logprobs, top_ids, top_logprobs, blocks = self.history.tensors()
        metadata = dict(self.request.metadata)
        if len(self.schedule_versions) > 1:
            metadata["schedule_versions"] = ",".join(map(str, self.schedule_versions))
        return RolloutSample(
            request_id=self.request.request_id,
            sample_index=self.sample_index,
            prompt_token_ids=list(self.token_ids[: self.prompt_len]),
            token_ids=torch.tensor(self.token_ids[self.prompt_len :], dtype=torch.long),
            logprobs=logprobs,
            top_ids=top_ids,
            top_logprobs=top_logprobs,
            blocks_attended=blocks,
            finish_reason=self.finish_reason,
            policy_version=policy_version,
            schedule_version=self.schedule_versions[-1],
            metadata=metadata,
        )
