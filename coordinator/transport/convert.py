"""Conversions between the `Sample` message and Sparrow's Python objects.

`Trajectory` is what travels from a rollout worker to the trainer pool: a `RolloutSample` plus the
ids that make resends idempotent and group samples for GRPO, and the reward when the worker scored it.
It is the only payload of the wire API: statistics, α histograms and schedules travel over Ray.
"""

from dataclasses import dataclass

import numpy as np
import torch

from sparrow.protos import sparrow_v1_pb2 as pb
from sparrow.rollout_workers.api import RolloutSample

from .validate import InvalidMessage, check_finish_reason, check_rows

FINISH_TO_PROTO = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH, "error": pb.FINISH_REASON_ERROR}
FINISH_FROM_PROTO = {v: k for k, v in FINISH_TO_PROTO.items()}


@dataclass
class Trajectory:
    sample: RolloutSample
    sample_id: str
    group_id: str
    reward: float | None = None
    worker_id: str = ""

    @classmethod
    def of(cls, sample: RolloutSample, reward: float | None = None, group_id: str | None = None,
           sample_id: str | None = None, worker_id: str = "") -> "Trajectory":
        """Default ids: the group is the request, the sample id is `<request_id>#<sample_index>`."""
        return cls(
            sample=sample,
            sample_id=sample_id if sample_id is not None else f"{sample.request_id}#{sample.sample_index}",
            group_id=group_id if group_id is not None else sample.request_id,
            reward=reward,
            worker_id=worker_id,
        )


def _tensor(values, dtype: np.dtype, torch_dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.fromiter(values, dtype=dtype, count=len(values))).to(torch_dtype)


def trajectory_to_proto(t: Trajectory) -> pb.Sample:
    s = t.sample
    if s.finish_reason not in FINISH_TO_PROTO:
        raise ValueError(f"finish_reason={s.finish_reason!r}: must be one of {sorted(FINISH_TO_PROTO)}")
    top_k = int(s.top_ids.shape[-1]) if s.top_ids.dim() == 2 else 0
    msg = pb.Sample(
        sample_id=t.sample_id,
        prompt_id=s.request_id,
        group_id=t.group_id,
        sample_index=s.sample_index,
        prompt_token_ids=list(s.prompt_token_ids),
        token_ids=s.token_ids.tolist(),
        logprobs=s.logprobs.float().tolist(),
        top_k=top_k,
        top_ids=s.top_ids.reshape(-1).tolist(),
        top_logprobs=s.top_logprobs.float().reshape(-1).tolist(),
        blocks_attended=s.blocks_attended.tolist(),
        policy_version=s.policy_version,
        schedule_version=s.schedule_version,
        finish_reason=FINISH_TO_PROTO[s.finish_reason],
        error=s.error or "",
        metadata=dict(s.metadata),
        worker_id=t.worker_id,
    )
    if t.reward is not None:
        msg.reward = float(t.reward)
    return msg


def _rows(values, n: int, k: int, field: str, dtype: np.dtype, torch_dtype: torch.dtype) -> torch.Tensor:
    check_rows(field, len(values), n, k)
    return _tensor(values, dtype, torch_dtype).view(n, k)


def trajectory_from_proto(msg: pb.Sample) -> Trajectory:
    """The sample a validated message carries (`validate_sample` checks the values). On its own it still never
    crashes: what it cannot convert (a negative `top_k`, top-k arrays of another size, an unknown finish
    reason) raises `InvalidMessage` naming the field, so the server rejects that sample and the stream goes on."""
    n, k = len(msg.token_ids), msg.top_k
    if k < 0:
        raise InvalidMessage("top_k", f"={k} must be >= 0")
    check_finish_reason(msg.finish_reason)
    sample = RolloutSample(
        request_id=msg.prompt_id,
        sample_index=msg.sample_index,
        prompt_token_ids=list(msg.prompt_token_ids),
        token_ids=_tensor(msg.token_ids, np.int64, torch.long),
        logprobs=_tensor(msg.logprobs, np.float32, torch.float32),
        top_ids=_rows(msg.top_ids, n, k, "top_ids", np.int64, torch.long),
        top_logprobs=_rows(msg.top_logprobs, n, k, "top_logprobs", np.float32, torch.float32),
        blocks_attended=_tensor(msg.blocks_attended, np.int32, torch.int32),
        finish_reason=FINISH_FROM_PROTO[msg.finish_reason],
        policy_version=msg.policy_version,
        schedule_version=msg.schedule_version,
        error=msg.error or None,
        metadata=dict(msg.metadata),
    )
    return Trajectory(
        sample=sample,
        sample_id=msg.sample_id,
        group_id=msg.group_id,
        reward=msg.reward if msg.HasField("reward") else None,
        worker_id=msg.worker_id,
    )
