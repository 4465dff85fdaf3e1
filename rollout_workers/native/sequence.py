"""One sample in flight: its tokens, its KV blocks, and what it has produced so far."""

from dataclasses import dataclass, field

import torch

from sparrow.rollout_workers.api import RolloutRequest, RolloutSample
from sparrow.schedule import DENSE_BUDGET

from .sampler import SampleOutput


@dataclass
class Draws:
    """One step's draw for a batch of sequences: the tokens and whether each row's logits were finite (on the
    host), and what a sample keeps per token (the sampler's output and the blocks attended, on the device)."""

    output: SampleOutput
    blocks: torch.Tensor
    tokens: list[int]
    finite: list[int]


class PendingDraws:
    """A step's draws on their way to the host: the tokens and finiteness flags (the step's only
    device-to-host copy; logprobs and top-k lists stay on the device until a sample ends) are copied into
    pinned memory without waiting, so the host can launch the next step before reading them (`resolve`)."""

    def __init__(self, output: SampleOutput, blocks: torch.Tensor, host: torch.Tensor, ready):
        self.output, self.blocks, self._host, self._ready = output, blocks, host, ready

    @classmethod
    def launch(cls, output: SampleOutput, blocks: torch.Tensor) -> "PendingDraws":
        flags = torch.stack([output.tokens, output.finite.long()])
        if flags.device.type != "cuda":
            return cls(output, blocks, flags, None)
        host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        host.copy_(flags, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(output, blocks, host, ready)

    def resolve(self) -> Draws:
        """Wait for the copy; the draws with their tokens on the host."""
        if self._ready is not None:
            self._ready.synchronize()
        tokens, finite = self._host.tolist()
        return Draws(self.output, self.blocks, tokens, finite)


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
    records: list[tuple[SampleOutput, torch.Tensor, int]] = field(default_factory=list)
    schedule_versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None

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
        self.records.append((draws.output, draws.blocks, row))
        if not self.schedule_versions or self.schedule_versions[-1] != schedule_version:
            self.schedule_versions.append(schedule_version)

    def to_sample(self, policy_version: int) -> RolloutSample:
        k = self.sampling.logprobs
        recs = self.records
        metadata = dict(self.request.metadata)
        if len(self.schedule_versions) > 1:
            metadata["schedule_versions"] = ",".join(map(str, self.schedule_versions))
        return RolloutSample(
            request_id=self.request.request_id,
            sample_index=self.sample_index,
            prompt_token_ids=list(self.token_ids[: self.prompt_len]),
            token_ids=torch.tensor(self.token_ids[self.prompt_len :], dtype=torch.long),
            logprobs=torch.stack([o.logprobs[r] for o, _, r in recs]).cpu(),
            top_ids=torch.stack([o.top_ids[r, :k] for o, _, r in recs]).cpu(),
            top_logprobs=torch.stack([o.top_logprobs[r, :k] for o, _, r in recs]).cpu(),
            blocks_attended=torch.stack([b[r] for _, b, r in recs]).to(torch.int32).cpu(),
            finish_reason=self.finish_reason,
            policy_version=policy_version,
            schedule_version=self.schedule_versions[-1],
            metadata=metadata,
        )
