"""Step records for tests: plausible `StepRecord`s built by step_record's own builders."""

import math

import torch

from sparrow.acceptance import AlphaHistogram
from sparrow.coordinator.metrics import BatchShape
from sparrow.coordinator.step_record import (
    BatchSummary, ControllerSummary, FaultEvent, GroupReport, PublishStats, StepRecord, StepTiming, alpha_tail,
    rollout_stats, schedule_snapshot,
)
from sparrow.schedule import SparsitySchedule

WORKERS = ("rollout-0", "rollout-1")
TOKENS_PER_BIN = (1200, 800, 300, 0)
"""The last bin measured nothing this step (it also decodes densely)."""


def make_record(step: int) -> StepRecord:
    """Step `step` of a 2-worker job with 4 length bins, built by step_record's own builders; numbers move
    with the step. Step 0 has a NaN grad norm; even steps are dense-probe steps; step 2 had a fault."""
    gen = torch.Generator().manual_seed(step)
    lower, upper = AlphaHistogram.empty(4), AlphaHistogram.empty(4)
    for b, n in enumerate(TOKENS_PER_BIN):
        alpha = 0.75 + 0.25 * torch.rand(n, generator=gen, dtype=torch.float64)
        lower.add(alpha, torch.full((n,), b))
        upper.add((alpha + 0.02).clamp(max=1.0), torch.full((n,), b))
    before = SparsitySchedule(name="t", topk_blocks=(3, 4, 4, None), edges=(136, 168, 200), version=max(step - 1, 0))
    schedule = before.with_topk((3, 4, 5 + step, None), version=step)
    rewards = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, float(step % 2), 1.0]
    summary = BatchSummary(
        samples=8, failed=1, errors=["reward timeout"], rewards=rewards, response_lengths=[40 + 7 * i + step for i in range(8)],
        prompt_lengths=[100, 102, 98, 101, 100, 99, 103, 100], truncated=1, staleness=[0, 1, 0, 0, 1, 0, 0, 1],
        kv_read_fraction=0.62 - 0.01 * step, schedule_versions=[max(step - 1, 0), step],
    )
    reports = [GroupReport(worker=w, samples=4, failed=0, tokens=600 + 50 * i + step, accepted=4, duplicate=i, rejected=[],
                           streams=1, sample_ids=[f"p{i}#{j}" for j in range(4)], seconds=3.5 + i) for i, w in enumerate(WORKERS)]
    return StepRecord(
        step=step, policy_version=step,
        rollout=rollout_stats(reports, summary, correct=1.0, rollout_seconds=4.5 + step,
                              speedup_measured=1.31 + 0.01 * step if step % 2 == 0 else None, requeued=int(step == 2),
                              utilisation={w: 0.93 - 0.2 * i - 0.01 * step for i, w in enumerate(WORKERS)}, speculated=0,
                              batch=BatchShape(busy_batch_fraction=0.62 - 0.01 * step, tail_share=0.21, peak=16)),
        train={"train/pg_loss": -0.012 * (step + 1), "train/entropy": 0.41 - 0.02 * step, "train/lr": 1e-5,
               "train/grad_norm": math.nan if step == 0 else 0.35 + 0.1 * step, "train/tis_capped_fraction": 0.003 * step},
        alpha=alpha_tail(lower, upper, 5.0),
        schedule=schedule_snapshot(schedule, before),
        controller=ControllerSummary(enabled=True, changes=int(step > 0)),
        predicted_speedup=1.42 + 0.05 * step,
        publish=PublishStats(version=step + 1, seconds=0.8 + 0.1 * step, send_seconds=0.5, bytes=538_000_000,
                             channel="object_store", waited=False),
        timing=StepTiming(rollout_wait=4.5 + step, collect=0.2, train=11.0 + step, publish=0.8, control=0.01,
                          step=16.5 + 2 * step, elapsed=16.5 * (step + 1)),
        faults=[FaultEvent(kind="rollout_lease_expired", subject="rollout-1", detail="lease of group 5 expired",
                           recovery_seconds=2.5, step=step)] if step == 2 else [],
    )
