"""Conversions between protobuf messages and Sparrow's Python objects.

`Trajectory` is what travels from a rollout worker to the trainer pool: a `RolloutSample` plus the
ids that make resends idempotent and group samples for GRPO, and the reward when the worker scored it.
"""

from dataclasses import dataclass

import numpy as np
import torch

from sparrow.acceptance import AlphaHistogram
from sparrow.protos import sparrow_v1_pb2 as pb
from sparrow.rollout_workers.api import RolloutSample
from sparrow.schedule import ScheduleError, SparsitySchedule

from .validate import InvalidMessage, validate_schedule

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


@dataclass
class StatsRecord:
    """One trainer's dense-recompute statistics for one step, as received by the monitor."""

    report_id: str
    trainer_id: str
    step: int
    policy_version: int
    schedule_version: int
    alpha: AlphaHistogram
    alpha_upper: AlphaHistogram | None
    metrics: dict[str, float]


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


def trajectory_from_proto(msg: pb.Sample) -> Trajectory:
    """Assumes `validate_sample` passed."""
    n, k = len(msg.token_ids), msg.top_k
    sample = RolloutSample(
        request_id=msg.prompt_id,
        sample_index=msg.sample_index,
        prompt_token_ids=list(msg.prompt_token_ids),
        token_ids=_tensor(msg.token_ids, np.int64, torch.long),
        logprobs=_tensor(msg.logprobs, np.float32, torch.float32),
        top_ids=_tensor(msg.top_ids, np.int64, torch.long).view(n, k),
        top_logprobs=_tensor(msg.top_logprobs, np.float32, torch.float32).view(n, k),
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


def histogram_to_proto(h: AlphaHistogram) -> pb.AlphaHistogram:
    bins, res = h.counts.shape
    flat = h.counts.reshape(-1)
    cells = flat.nonzero().squeeze(-1)
    return pb.AlphaHistogram(
        num_length_bins=bins,
        resolution=res,
        cells=cells.tolist(),
        counts=flat[cells].tolist(),
        sums=h.sums.tolist(),
    )


def histogram_from_proto(msg: pb.AlphaHistogram) -> AlphaHistogram:
    """Assumes `validate_histogram` passed."""
    h = AlphaHistogram.empty(msg.num_length_bins, msg.resolution)
    if len(msg.cells):
        cells = _tensor(msg.cells, np.int64, torch.long)
        h.counts.view(-1)[cells] = _tensor(msg.counts, np.int64, torch.long)
    h.sums = _tensor(msg.sums, np.float64, torch.float64)
    return h


def stats_to_proto(r: StatsRecord) -> pb.StatsReport:
    msg = pb.StatsReport(
        report_id=r.report_id,
        trainer_id=r.trainer_id,
        step=r.step,
        policy_version=r.policy_version,
        schedule_version=r.schedule_version,
        alpha=histogram_to_proto(r.alpha),
        metrics={k: float(v) for k, v in r.metrics.items()},
    )
    if r.alpha_upper is not None:
        msg.alpha_upper.CopyFrom(histogram_to_proto(r.alpha_upper))
    return msg


def stats_from_proto(msg: pb.StatsReport) -> StatsRecord:
    """Assumes `validate_stats_report` passed."""
    return StatsRecord(
        report_id=msg.report_id,
        trainer_id=msg.trainer_id,
        step=msg.step,
        policy_version=msg.policy_version,
        schedule_version=msg.schedule_version,
        alpha=histogram_from_proto(msg.alpha),
        alpha_upper=histogram_from_proto(msg.alpha_upper) if msg.HasField("alpha_upper") else None,
        metrics=dict(msg.metrics),
    )


def schedule_to_proto(s: SparsitySchedule) -> pb.Schedule:
    return pb.Schedule(
        name=s.name,
        topk_blocks=[-1 if v is None else v for v in s.topk_blocks],
        edges=list(s.edges),
        sink=s.sink,
        recent=s.recent,
        block_size=s.block_size,
        version=s.version,
        source=s.source,
        notes=list(s.notes),
    )


def schedule_from_proto(msg: pb.Schedule) -> SparsitySchedule:
    """Raises InvalidMessage (field `schedule...`) for a schedule that cannot be used."""
    validate_schedule(msg)
    try:
        return SparsitySchedule(
            name=msg.name,
            topk_blocks=tuple(None if v == -1 else v for v in msg.topk_blocks),
            edges=tuple(msg.edges),
            sink=msg.sink,
            recent=msg.recent,
            block_size=msg.block_size,
            version=msg.version,
            source=msg.source,
            notes=tuple(msg.notes),
        )
    except ScheduleError as exc:
        raise InvalidMessage("schedule", str(exc)) from None
