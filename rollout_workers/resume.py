"""Partial rollouts: resuming interrupted samples and joining their parts into one sample.

A sample interrupted at a weight change (`RolloutEngine.interrupt`) keeps its tokens with their rollout
log-probabilities, top-k and blocks attended. It resumes as a request of its own: the original prompt plus those
tokens as the prompt, what is left of `max_tokens`, one sample, under the weights in force then. `join` puts the
parts back together, so each token keeps the log-probability under the policy that sampled it (importance weights
and α stay exact); the sample's `policy_version` is its oldest part's (its staleness), and
`metadata["policy_versions"]`, when it spans more than one, says where each version's tokens start ("0:3,120:4": tokens 0.. sampled by policy
version 3, tokens 120.. by version 4).
"""

from dataclasses import replace

import torch

from sparrow.seeds import stable_seed

from .api import RolloutRequest, RolloutSample


def resume_request(request: RolloutRequest, sample_index: int, parts: list[RolloutSample]) -> RolloutRequest:
    """The request that continues sample `sample_index` of `request` after the `parts` it generated so far."""
    done = [int(t) for p in parts for t in p.token_ids.tolist()]
    s = request.sampling
    seed = None if s.seed is None else stable_seed(s.seed, sample_index, len(done))
    sampling = replace(s, n=1, max_tokens=s.max_tokens - len(done), seed=seed)
    return RolloutRequest(resume_id(request.request_id, sample_index, len(parts)), tuple(request.prompt_token_ids) + tuple(done),
                          sampling, metadata=dict(request.metadata))


def resume_id(request_id: str, sample_index: int, part: int) -> str:
    """The engine request id of part `part` (1, 2, ...) of a sample; never a sample id the trainer sees."""
    return f"{request_id}~{sample_index}.{part}"


def tokens_by_version(sample: RolloutSample) -> dict[int, int]:
    """How many of the sample's tokens each policy version sampled (from `metadata["policy_versions"]` when it spans
    more than one, else all of them by its `policy_version`)."""
    total = int(sample.token_ids.numel())
    spans = sample.metadata.get("policy_versions")
    if not spans:
        return {sample.policy_version: total} if total else {}
    starts = [tuple(int(x) for x in span.split(":")) for span in spans.split(",")]
    counts: dict[int, int] = {}
    for (offset, version), (end, _) in zip(starts, starts[1:] + [(total, None)]):
        counts[version] = counts.get(version, 0) + end - offset
    return counts


def join(request: RolloutRequest, sample_index: int, parts: list[RolloutSample]) -> RolloutSample:
    """One sample of `request` from its parts in order (the last one finished, the others were interrupted)."""
    last = parts[-1]
    if len(parts) == 1:
        return last
    started = [p for p in parts if p.token_ids.numel()]
    if last.finish_reason == "error" or not started:
        return replace(last, request_id=request.request_id, sample_index=sample_index,
                       prompt_token_ids=list(request.prompt_token_ids), metadata=dict(request.metadata))
    starts, offset = [], 0
    for p in started:
        if not starts or starts[-1][1] != p.policy_version:
            starts.append((offset, p.policy_version))
        offset += int(p.token_ids.numel())
    schedules = []
    for p in started:
        for v in p.metadata.get("schedule_versions", str(p.schedule_version)).split(","):
            if not schedules or schedules[-1] != v:
                schedules.append(v)
    metadata = dict(request.metadata)
    if len(starts) > 1:
        metadata["policy_versions"] = ",".join(f"{o}:{v}" for o, v in starts)
    if len(schedules) > 1:
        metadata["schedule_versions"] = ",".join(schedules)
    return RolloutSample(
        request_id=request.request_id, sample_index=sample_index, prompt_token_ids=list(request.prompt_token_ids),
        token_ids=torch.cat([p.token_ids for p in started]), logprobs=torch.cat([p.logprobs for p in started]),
        top_ids=torch.cat([p.top_ids for p in started]), top_logprobs=torch.cat([p.top_logprobs for p in started]),
        blocks_attended=torch.cat([p.blocks_attended for p in started]), finish_reason=last.finish_reason,
        policy_version=min(p.policy_version for p in started), schedule_version=last.schedule_version,
        metadata=metadata,
    )
