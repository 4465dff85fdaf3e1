"""The typed step record: JSON round trip, the tail-bracketing check, and the report it feeds."""

from dataclasses import replace

from records import make_record

from sparrow.coordinator.report import write_report
from sparrow.coordinator.run_dir import RunDir
from sparrow.coordinator.step_record import LOOSE_BOUND_GAP, StepRecord, loose_tail_advice


def test_a_record_survives_its_json_line():
    record = make_record(2)
    assert StepRecord.from_dict(record.to_dict()) == record


def test_a_tail_bracketed_too_loosely_is_named_per_bin():
    record = make_record(1)
    tight = record.alpha
    assert tight.loose_bins() == [] and all(g is None or 0 <= g <= LOOSE_BOUND_GAP for g in tight.bound_gaps)
    flat = replace(tight, p5_upper=[None if p is None else min(1.0, p + 0.3) for p in tight.p5])
    assert flat.loose_bins() == [b for b, p in enumerate(tight.p5) if p is not None]
    assert replace(tight, p5_upper=None).loose_bins() == []


def test_the_report_warns_when_the_tail_was_only_bracketed(tmp_path):
    run_dir = RunDir.create(tmp_path, "run")
    for step in range(3):
        record = make_record(step)
        if step == 1:
            record = replace(record, alpha=replace(record.alpha, p5_upper=[None if p is None else p + 0.2 for p in record.alpha.p5]))
        run_dir.append(run_dir.metrics_file, record.to_dict())
    text = write_report(run_dir).read_text()
    assert "The α tail was only bracketed in 1 of 3 steps" in text and "up to 0.20" in text
    assert "controller.statistic: midpoint" in text


def test_the_loose_tail_advice_never_suggests_the_statistic_in_use():
    assert "controller.statistic: midpoint" in loose_tail_advice("lower")
    assert "controller.statistic: upper" in loose_tail_advice("midpoint")
    assert "controller.statistic: upper" not in loose_tail_advice("upper") and "optimistic" in loose_tail_advice("upper")
    assert all("controller.statistic: exact with trainer.exact_alpha: true" in loose_tail_advice(s)
               for s in ("lower", "midpoint", "upper", None))
    assert all("rollout.sampling.logprobs and trainer.recompute_topk" in loose_tail_advice(s)
               for s in ("lower", "midpoint", "upper", None))


def test_the_report_names_bins_below_tau_on_the_lower_bound_and_on_exact_alpha(tmp_path):
    run_dir = RunDir.create(tmp_path, "run")
    for step in range(2):
        record = make_record(step)
        if step == 1:  # trainer.exact_alpha: bin 0's tail below τ by exact α too, bin 2's only by the bound
            record = replace(record, alpha=replace(record.alpha, p5=[0.82, 0.90, 0.84, None]),
                             alpha_exact=replace(record.alpha, p5=[0.80, 0.95, 0.90, None], p5_upper=None))
        run_dir.append(run_dir.metrics_file, record.to_dict())
    text = write_report(run_dir).read_text()
    lower = next(line for line in text.splitlines() if "at the last step (lower bound)" in line)
    exact = next(line for line in text.splitlines() if "at the last step (exact α)" in line)
    assert lower.split()[-2:] == ["0,", "2"] and exact.split()[-1] == "0"
    assert (run_dir.report / "alpha_tail.png").stat().st_size > 0
