"""`step_scalars`: a `StepRecord` as the flat `{tag: number}` that TensorBoard and W&B plot.

A tag is the value's place in the metrics.jsonl line (`rollout/reward_mean`, `timing/train`, the
trainer's own `train/*` names), with `/bin<b>` per length bin and `/<worker>` per rollout worker;
the two speedups are grouped as `speedup/predicted` and `speedup/measured`. A value metrics.jsonl
writes as null is left out: None (not measured, e.g. the α tail of a bin without tokens, the
measured speedup of a step without a dense probe) and NaN/inf. A dense bin has no
`schedule/blocks/bin<b>` (no budget; a number would plot as one) and `schedule/dense/bin<b>` = 1,
like Prometheus' `sparrow_schedule_budget_blocks` (NaN) and `sparrow_schedule_dense` (1).
A held-out evaluation during the step adds `eval/<mode>/{accuracy,reward_mean,response_length_mean}`
and `eval/policy_version` (the last one of the step when there were two).
"""

import math

from sparrow.coordinator.step_record import StepRecord


def _per_bin(prefix: str, values) -> dict:
    return {f"{prefix}/bin{b}": v for b, v in enumerate(values or [])}


def _per_worker(prefix: str, values: dict) -> dict:
    return {f"{prefix}/{worker}": v for worker, v in values.items()}


def step_scalars(record: StepRecord) -> dict[str, float]:
    r, a, s, p, t = record.rollout, record.alpha, record.schedule, record.publish, record.timing
    values = {
        "policy/version": record.policy_version,
        "rollout/samples": r.samples,
        "rollout/failed": r.failed,
        "rollout/tokens": r.tokens,
        "rollout/reward_mean": r.reward_mean,
        "rollout/reward_std": r.reward_std,
        "rollout/accuracy": r.accuracy,
        "rollout/response_length_mean": r.response_length_mean,
        "rollout/response_length_max": r.response_length_max,
        "rollout/prompt_length_mean": r.prompt_length_mean,
        "rollout/truncated_fraction": r.truncated_fraction,
        "rollout/tokens_per_s": r.tokens_per_s,
        "rollout/kv_read_fraction": r.kv_read_fraction,
        "rollout/staleness_mean": r.staleness_mean,
        "rollout/staleness_max": r.staleness_max,
        "rollout/accepted": r.accepted,
        "rollout/duplicates": r.duplicates,
        "rollout/streams": r.streams,
        "rollout/requeued": r.requeued,
        "rollout/speculated": r.speculated,
        "rollout/dropped": r.dropped,
        "rollout/busy_batch_fraction": r.busy_batch_fraction,
        "rollout/tail_share": r.tail_share,
        "rollout/peak_batch": r.peak_batch,
        "rollout/carried_in": r.carried_in,
        "rollout/carried_out": r.carried_out,
        "rollout/closed_by_budget": int(r.closed_by_budget),
        "rollout/resumed_samples": r.resumed_samples,
        **_per_worker("rollout/staleness_histogram", r.staleness_histogram),
        **_per_worker("rollout/utilisation", r.utilisation),
        **_per_worker("rollout/groups", r.groups),
        **(record.train or {}),
        **_per_bin("alpha/p5", a.p5),
        **_per_bin("alpha/p5_upper", a.p5_upper),
        **_per_bin("alpha/mean", a.mean),
        **_per_bin("alpha/tokens", a.tokens),
        **_per_bin("alpha/p5_exact", record.alpha_exact.p5 if record.alpha_exact else None),
        "schedule/version": s.version,
        **_per_bin("schedule/blocks", s.blocks),
        **_per_bin("schedule/dense", [int(blocks is None) for blocks in s.blocks]),
        "controller/changes": record.controller.changes,
        "speedup/predicted": record.predicted_speedup,
        "speedup/measured": r.speedup_measured,
        "publish/seconds": p.seconds,
        "publish/send_seconds": p.send_seconds,
        "publish/bytes": p.bytes,
        "timing/rollout_wait": t.rollout_wait,
        "timing/collect": t.collect,
        "timing/train": t.train,
        "timing/publish": t.publish,
        "timing/control": t.control,
        "timing/step": t.step,
        "timing/elapsed": t.elapsed,
        "timing/evaluate": t.evaluate,
        "faults/count": len(record.faults),
    }
    for evaluation in record.evaluations:
        values["eval/policy_version"] = evaluation.policy_version
        for e in evaluation.results:
            values.update({f"eval/{e.mode}/accuracy": e.accuracy, f"eval/{e.mode}/reward_mean": e.reward_mean,
                           f"eval/{e.mode}/response_length_mean": e.response_length_mean})
    return {tag: float(v) for tag, v in values.items() if v is not None and math.isfinite(v)}
