"""`StepRecord`: everything one training step produced, as one typed value.

`build_step_record` makes it from a step's results (pure: no I/O, no clocks); the JSONL metrics
(`to_dict`), the progress line, Prometheus (`SparrowMetrics.record_step`), the experiment loggers and
the report (`from_dict` on each JSONL line) all read its fields. The JSON layout is the documented
`metrics.jsonl` line (docs/coordinator.md).
"""

import dataclasses
import statistics
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sparrow.acceptance import AlphaHistogram
from sparrow.schedule import SparsitySchedule

if TYPE_CHECKING:
    from .metrics.throughput import BatchShape


@dataclass
class BatchSummary:
    """What rank 0's `collect` reports about a step's samples (failed ones included in the counts)."""

    samples: int
    failed: int
    errors: list[str]
    rewards: list[float]
    response_lengths: list[int]
    prompt_lengths: list[int]
    truncated: int
    staleness: list[int]
    kv_read_fraction: float
    schedule_versions: list[int]
    dropped: int = 0
    """Samples of abandoned lease attempts (a worker lost its group) discarded instead of trained."""
    dropped_ids: list[str] = field(default_factory=list)
    """Their sample ids (the run's ledger lists them)."""
    resumed: int = 0
    """Samples whose tokens span more than one policy version (partial rollouts: interrupted and resumed)."""
    stale_tokens: int = 0
    """Tokens sampled by an older policy than the one trained (partial rollouts: carried and resumed samples)."""


@dataclass
class GroupReport:
    """What a rollout worker reports when it completes one leased GRPO group."""

    worker: str
    samples: int
    failed: int
    tokens: int
    accepted: int
    duplicate: int
    rejected: list[tuple[str, str, str]]
    """(sample id, field, message) of every sample the trajectory server refused."""
    streams: int
    sample_ids: list[str]
    """Ids the trajectory server acknowledged (accepted or duplicate): what the trainer collects."""
    seconds: float
    """From the lease to the last acknowledgement."""


@dataclass
class RolloutStats:
    samples: int
    failed: int
    tokens: int
    reward_mean: float | None
    reward_std: float | None
    accuracy: float | None
    response_length_mean: float | None
    response_length_max: int | None
    prompt_length_mean: float | None
    truncated_fraction: float
    tokens_per_s: float | None
    speedup_measured: float | None
    kv_read_fraction: float
    staleness_mean: float | None
    staleness_max: int | None
    schedule_versions: list[int]
    accepted: int
    duplicates: int
    streams: int
    requeued: int = 0
    """Groups generated again because the worker holding them was lost or its lease expired."""
    speculated: int = 0
    """Groups also given to a second worker while the first held them (`run.recovery.speculate_after_s`)."""
    dropped: int = 0
    """Samples of abandoned attempts discarded by the trainer (never trained)."""
    utilisation: dict[str, float] = field(default_factory=dict)
    """Per rollout worker: seconds its engine had work over the wall seconds since the previous step's rollouts."""
    groups: dict[str, int] = field(default_factory=dict)
    """Per rollout worker: GRPO groups of this step it completed (a fast worker takes more)."""
    busy_batch_fraction: float | None = None
    """Samples in flight over max_num_seqs, time-weighted over the engines' busy time since the previous step's
    rollouts (pooled over workers): how full the decode batch stayed."""
    tail_share: float | None = None
    """Share of that time with fewer than half of `peak_batch` in flight: the long tail of the rollout."""
    peak_batch: int | None = None
    """The most samples one engine had in flight."""
    carried_in: int = 0
    """Partial rollouts: groups earlier steps handed to this one (trained here or carried on)."""
    carried_out: int = 0
    """Partial rollouts: this step's groups handed to the next step when it closed (done, generating or queued)."""
    closed_by_budget: bool = False
    """Partial rollouts: the step closed at its time budget (`close_after_s`) with fewer than prompts_per_step
    groups done; it trained those."""
    resumed_samples: int = 0
    """Trained samples whose tokens span more than one policy version (interrupted, then resumed)."""
    stale_tokens: int = 0
    """Trained tokens sampled by an older policy than the one trained (partial rollouts: the carried-over share)."""
    staleness_histogram: dict[str, int] = field(default_factory=dict)
    """Trained samples by how many policy versions their oldest token lags the trained policy ("0", "1", ...)."""


LOOSE_BOUND_GAP = 0.05
"""A tail whose top-k upper and lower bounds differ by more than this is not measured, only bracketed."""


def loose_tail_advice(statistic: str | None) -> str:
    """What to change when the tail is only bracketed, for the controller's `statistic` (None: not known).

    Measured on SmolLM2-135M (docs/stability.md, "Which α"): with top-20 lists the lower bound's p5 sits far
    below exact α (0.29 under dense rollout at temperature 1.0, 0.89 at 0.7), the upper bound's up to 0.11 above
    it; top-64 lists bring the lower bound to within 0.03-0.07 and the upper to within 0.005."""
    fix = "raise rollout.sampling.logprobs and trainer.recompute_topk together (up to 64)"
    exact = ("; or steer on α itself: controller.statistic: exact with trainer.exact_alpha: true (one dense and one "
             "sparse forward of the step's tokens in the trainer)")
    if statistic == "upper":
        return fix + "; the upper bound is optimistic, so the tail may be below what the controller sees" + exact
    if statistic in (None, "lower"):
        return fix + ", or set controller.statistic: midpoint (closer to α, still below it where the lists miss much)" + exact
    return fix + (", or set controller.statistic: upper (close to α but above it: raise controller.target by the margin "
                  "sparrow calibrate measures for the model)") + exact


@dataclass
class AlphaTail:
    percentile: float
    p5: list[float | None]
    """The tail percentile (lower bound of α) per length bin; None where a bin measured no tokens."""
    p5_upper: list[float | None] | None
    tokens: list[int]
    mean: list[float | None]

    @property
    def bound_gaps(self) -> list[float | None]:
        """Per bin, upper minus lower bound of the tail: how much of the distribution the top-k lists miss."""
        if self.p5_upper is None:
            return [None] * len(self.p5)
        return [None if lo is None or up is None else up - lo for lo, up in zip(self.p5, self.p5_upper)]

    def loose_bins(self) -> list[int]:
        """Bins whose tail is bracketed too loosely to be measured (flat distributions, too small a top-k)."""
        return [b for b, gap in enumerate(self.bound_gaps) if gap is not None and gap > LOOSE_BOUND_GAP]

    def bins_below(self, target: float) -> list[int]:
        """Bins that measured tokens and whose tail is below `target`."""
        return [b for b, (p, n) in enumerate(zip(self.p5, self.tokens)) if n and p is not None and p < target]


@dataclass
class ScheduleSnapshot:
    version: int
    topk_blocks: list[int | None]
    blocks: list[int | None]
    edges: list[int]
    blocks_before: list[int | None]


@dataclass
class ControllerSummary:
    enabled: bool
    changes: int


@dataclass
class PublishStats:
    version: int
    seconds: float
    send_seconds: float
    bytes: int
    channel: str
    waited: bool


@dataclass
class StepTiming:
    rollout_wait: float
    collect: float
    train: float
    publish: float
    control: float
    step: float
    elapsed: float
    evaluate: float = 0.0
    """Seconds spent on a held-out evaluation after this step's update (data.eval)."""
    to_train: float = 0.0
    """Colocated placement: from the step's last rollout until the trainer held the GPU (engines asleep, trainer
    states reloaded)."""
    to_rollout: float = 0.0
    """Colocated placement: from the handed-over version until the engines could generate (trainer states
    offloaded, engines awake with their decode graphs recaptured)."""
    transitions: dict[str, float] = field(default_factory=dict)
    """The two transitions' parts: engine_sleep, trainer_reload, trainer_offload, engine_wake (s), kv_gb_released."""


@dataclass
class FaultEvent:
    """A failure the job recovered from, with how long recovery took."""

    kind: str
    """"rollout_worker_lost", "rollout_lease_expired", "trainer_lost", "publish_refused", "pool_resized"."""
    subject: str
    """The worker or rank (e.g. "rollout-1", "trainer")."""
    detail: str
    recovery_seconds: float | None
    """From detection until the replacement took work / the trainer resumed (None: not recovered yet)."""
    step: int


@dataclass
class EvalResult:
    """The held-out set decoded in one mode (dense, or sparse under the schedule in force)."""

    mode: str
    accuracy: float | None
    reward_mean: float | None
    response_length_mean: float | None
    samples: int
    tokens: int
    seconds: float


@dataclass
class EvalRecord:
    """One evaluation of policy `policy_version` on the held-out prompts (`data.eval`)."""

    policy_version: int
    prompts: int
    decoding: str
    schedule_version: int
    results: list[EvalResult]

    @classmethod
    def from_dict(cls, data: dict) -> "EvalRecord":
        return cls(**{**data, "results": [EvalResult(**r) for r in data["results"]]})


@dataclass
class StepRecord:
    step: int
    policy_version: int
    """The policy that trained on this step's samples (the update makes version + 1)."""
    rollout: RolloutStats
    train: dict[str, float] | None
    alpha: AlphaTail
    schedule: ScheduleSnapshot
    controller: ControllerSummary
    predicted_speedup: float | None
    publish: PublishStats
    timing: StepTiming
    faults: list[FaultEvent] = field(default_factory=list)
    evaluations: list[EvalRecord] = field(default_factory=list)
    """Evaluations finished during this step: before the first step (policy 0) and after every data.eval.every-th."""
    alpha_exact: AlphaTail | None = None
    """Exact α of the same tokens (trainer.exact_alpha), beside `alpha`'s top-k bounds."""

    @property
    def tis_capped_fraction(self) -> float | None:
        return (self.train or {}).get("train/tis_capped_fraction")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "StepRecord":
        parts = {"rollout": RolloutStats, "alpha": AlphaTail, "schedule": ScheduleSnapshot, "controller": ControllerSummary,
                 "publish": PublishStats, "timing": StepTiming}
        values = {k: (parts[k](**v) if k in parts else v) for k, v in data.items()}
        values["alpha_exact"] = AlphaTail(**data["alpha_exact"]) if data.get("alpha_exact") else None
        values["faults"] = [FaultEvent(**f) for f in data.get("faults", [])]
        values["evaluations"] = [EvalRecord.from_dict(e) for e in data.get("evaluations", [])]
        return cls(**values)


def mean_known(values) -> float | None:
    """The mean of the values that are not None (None if there are none): how an optional field of the step
    record averages over samples or steps, here and in every summary of step records."""
    known = [v for v in values if v is not None]
    return statistics.fmean(known) if known else None


def _per_bin(values, counts: list[int]) -> list[float | None]:
    return [None if n == 0 else float(v) for v, n in zip(values.tolist(), counts)]


def alpha_tail(alpha: AlphaHistogram, upper: AlphaHistogram | None, percentile: float) -> AlphaTail:
    counts = alpha.count().tolist()
    return AlphaTail(
        percentile=percentile, p5=_per_bin(alpha.percentile(percentile), counts),
        p5_upper=None if upper is None else _per_bin(upper.percentile(percentile), counts),
        tokens=counts, mean=_per_bin(alpha.mean(), counts),
    )


def schedule_snapshot(schedule: SparsitySchedule, before: SparsitySchedule) -> ScheduleSnapshot:
    return ScheduleSnapshot(
        version=schedule.version, topk_blocks=list(schedule.topk_blocks),
        blocks=[schedule.blocks_for_bin(b) for b in range(schedule.num_bins)], edges=list(schedule.edges),
        blocks_before=[before.blocks_for_bin(b) for b in range(before.num_bins)],
    )


def rollout_stats(reports: list[GroupReport], summary: BatchSummary, correct: float, rollout_seconds: float,
                  speedup_measured: float | None, requeued: int, utilisation: dict[str, float],
                  speculated: int, batch: "BatchShape | None" = None, carried_in: int = 0,
                  carried_out: int = 0, closed_by_budget: bool = False) -> RolloutStats:
    rewards, lengths = summary.rewards, summary.response_lengths
    tokens = sum(r.tokens for r in reports)
    return RolloutStats(
        samples=summary.samples, failed=summary.failed, tokens=tokens,
        reward_mean=mean_known(rewards), reward_std=statistics.pstdev(rewards) if len(rewards) > 1 else None,
        accuracy=mean_known([r >= correct for r in rewards]),
        response_length_mean=mean_known(lengths), response_length_max=max(lengths, default=None),
        prompt_length_mean=mean_known(summary.prompt_lengths),
        truncated_fraction=summary.truncated / max(len(lengths), 1),
        tokens_per_s=tokens / rollout_seconds if rollout_seconds > 0 else None,
        speedup_measured=speedup_measured, kv_read_fraction=summary.kv_read_fraction,
        staleness_mean=mean_known(summary.staleness), staleness_max=max(summary.staleness, default=None),
        schedule_versions=summary.schedule_versions,
        accepted=sum(r.accepted for r in reports), duplicates=sum(r.duplicate for r in reports),
        streams=sum(r.streams for r in reports), requeued=requeued, speculated=speculated, dropped=summary.dropped,
        utilisation=utilisation, groups=dict(Counter(r.worker for r in reports)),
        carried_in=carried_in, carried_out=carried_out, closed_by_budget=closed_by_budget, resumed_samples=summary.resumed,
        stale_tokens=summary.stale_tokens,
        staleness_histogram={str(lag): count for lag, count in sorted(Counter(summary.staleness).items())},
        **({} if batch is None else {"busy_batch_fraction": batch.busy_batch_fraction, "tail_share": batch.tail_share,
                                     "peak_batch": batch.peak or None}),
    )
