"""The job's one-line notices: the long-tail hint is said once, after the warm-up step, to GPU engines without
partial rollouts."""

from dataclasses import replace

from records import make_record

from sparrow.coordinator.job.notices import Notices


def _with_tail(step: int, share: float | None):
    record = make_record(step)
    return replace(record, rollout=replace(record.rollout, tail_share=share))


def test_a_rollout_that_was_mostly_its_long_tail_points_at_partial_rollouts_once():
    lines: list[str] = []
    notices = Notices(lines.append, logprobs=20, statistic="exact", hint_long_tail=True)
    for step, share in [(0, 0.9), (1, 0.3), (2, None), (3, 0.67), (4, 0.8)]:
        notices.after_step(_with_tail(step, share))
    tail = [line for line in lines if "below half its peak batch" in line]
    assert tail == [tail[0]] and tail[0].startswith("step 4: 67% of the rollout ran below half its peak batch"), lines
    assert "run.partial_rollout" in tail[0] and "sparrow bench tail-model" in tail[0]


def test_a_job_not_to_hint_is_not_told():
    lines: list[str] = []
    notices = Notices(lines.append, logprobs=20, statistic="exact")
    notices.after_step(_with_tail(3, 0.9))
    assert not [line for line in lines if "peak batch" in line]
