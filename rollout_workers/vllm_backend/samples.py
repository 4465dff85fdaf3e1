"""Turning vLLM's streamed outputs into `RolloutSample`s, blocks attended included.

vLLM does not report which KV blocks a forward pass read, but Sparrow's budget is a function of the
total length L alone: the pass that produced generated token t had context L = prompt_len + t
(token 0 comes from the prefill, which is dense) and attended `min(ceil(L / block_size), budget(L))` blocks
per KV head in every sparse layer, budget(L) from the schedule in force at that step. So the engine
only needs to know which schedule was in force for which tokens: each sample keeps a list of
(first token index, schedule) segments, extended at every `set_schedule` with the token count the
worker reported at the moment of the switch.
"""

from dataclasses import dataclass, field

import torch

from sparrow.layout import BLOCK_SIZE
from sparrow.rollout_workers.api import INTERRUPTED, RolloutRequest, RolloutSample
from sparrow.schedule import SparsitySchedule

FINISH_REASONS = {"stop": "stop", "length": "length", INTERRUPTED: INTERRUPTED}


def blocks_attended_per_token(
    prompt_len: int,
    num_tokens: int,
    segments: list[tuple[int, SparsitySchedule | None]],
    block_size: int = BLOCK_SIZE,
) -> torch.Tensor:
    """Blocks per KV head the sparse layers attended when producing each of `num_tokens` tokens.

    `segments` are (first token index, schedule or None for dense), in increasing index order.
    """
    lengths = prompt_len + torch.arange(num_tokens, dtype=torch.long)
    blocks = (lengths + block_size - 1) // block_size
    out = blocks.clone()
    bounds = [start for start, _ in segments[1:]] + [num_tokens]
    for (start, schedule), end in zip(segments, bounds):
        lo, hi = max(start, 1), min(end, num_tokens)
        if schedule is None or lo >= hi:
            continue
        budgets = schedule.budgets_for_lengths(lengths[lo:hi]).clamp(min=schedule.sink + schedule.recent)
        out[lo:hi] = torch.minimum(blocks[lo:hi], budgets)
    return out.to(torch.int32)


def schedule_version(schedule: SparsitySchedule | None) -> int:
    return -1 if schedule is None else schedule.version


@dataclass
class SampleBuilder:
    """One sample in flight: everything vLLM streamed for it so far, and its schedule segments."""

    request: RolloutRequest
    sample_index: int
    num_logprobs: int
    segments: list[tuple[int, SparsitySchedule | None]]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def switch_schedule(self, at_token: int, schedule: SparsitySchedule | None) -> None:
        """Tokens from index `at_token` on are decoded under `schedule`."""
        self.segments = [(s, sch) for s, sch in self.segments if s < at_token] + [(at_token, schedule)]

    def add(self, completion) -> None:
        """Append one DELTA `CompletionOutput`: new token ids, their logprob dicts, finish reason."""
        if completion.logprobs is None or len(completion.logprobs) != len(completion.token_ids):
            raise RuntimeError("vLLM returned tokens without logprobs; the engine asks for them on every request")
        k = self.num_logprobs
        for token, candidates in zip(completion.token_ids, completion.logprobs):
            self.token_ids.append(int(token))
            self.logprobs.append(float(candidates[token].logprob))
            ranked = sorted((c.rank, -c.logprob, int(i)) for i, c in candidates.items() if c.rank is not None and c.rank <= k)
            self.top_ids.append([i for _, _, i in ranked[:k]])
            self.top_logprobs.append([-neg for _, neg, _ in ranked[:k]])
        if completion.finish_reason is not None:
            self.finish_reason = completion.finish_reason

    def versions(self) -> list[int]:
        """Schedule versions that decoded at least one token, in order."""
        used = []
        bounds = [start for start, _ in self.segments[1:]] + [self.num_tokens]
        for (start, schedule), end in zip(self.segments, bounds):
            if end > start and (not used or used[-1] != schedule_version(schedule)):
                used.append(schedule_version(schedule))
        return used or [schedule_version(self.segments[-1][1])]

    def build(self, policy_version: int, block_size: int = BLOCK_SIZE) -> RolloutSample:
        reason = FINISH_REASONS.get(self.finish_reason)
        versions = self.versions()
        if reason is None:
            return RolloutSample.failed(
                self.request, self.sample_index, f"vLLM finished the request with reason {self.finish_reason!r}",
                policy_version, versions[-1],
            )
        metadata = dict(self.request.metadata)
        if len(versions) > 1:
            metadata["schedule_versions"] = ",".join(map(str, versions))
        k = self.num_logprobs
        if any(len(ids) != k for ids in self.top_ids):
            raise RuntimeError(f"vLLM returned fewer than the {k} top logprobs asked for")
        return RolloutSample(
            request_id=self.request.request_id,
            sample_index=self.sample_index,
            prompt_token_ids=list(self.request.prompt_token_ids),
            token_ids=torch.tensor(self.token_ids, dtype=torch.long),
            logprobs=torch.tensor(self.logprobs, dtype=torch.float32),
            top_ids=torch.tensor(self.top_ids, dtype=torch.long).view(self.num_tokens, k),
            top_logprobs=torch.tensor(self.top_logprobs, dtype=torch.float32).view(self.num_tokens, k),
            blocks_attended=blocks_attended_per_token(
                len(self.request.prompt_token_ids), self.num_tokens, self.segments, block_size
            ),
            finish_reason=reason,
            policy_version=policy_version,
            schedule_version=versions[-1],
            metadata=metadata,
        )
