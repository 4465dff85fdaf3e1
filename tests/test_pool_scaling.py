"""benchmarks/pool_scaling.py (issue 17's harness): what it reads from step records — workers serving, rollout
tokens/s, samples trained, lost and duplicated — the sweep's medians and scaling efficiency, the tables, and
its refusals. The jobs it runs are `sparrow train` itself (the resize under load: tests/test_reliability.py)."""

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from pool_scaling import _run, main, per_step, resize_table, sweep_summary, sweep_table, with_efficiency  # noqa: E402


def record(step: int, workers: int, tokens_per_s: float, accepted: int, duplicates: int = 0) -> dict:
    return {"step": step, "timing": {"step": 2.0 + step},
            "rollout": {"tokens_per_s": tokens_per_s, "accepted": accepted, "duplicates": duplicates, "requeued": 1,
                        "utilisation": {f"rollout-{w}": 0.5 + 0.1 * w for w in range(workers)}}}


def test_steps_sweep_rows_and_efficiency():
    one = per_step([record(0, 1, 50.0, 16), record(1, 1, 100.0, 16), record(2, 1, 110.0, 15)], expected=16)
    assert [s["workers"] for s in one] == [1, 1, 1] and [s["lost"] for s in one] == [0, 0, 1]
    four = per_step([record(0, 4, 90.0, 16), record(1, 4, 360.0, 16, duplicates=2), record(2, 4, 380.0, 16)], 16)
    assert four[1]["utilisation"] == pytest.approx(0.65)
    rows = with_efficiency([sweep_summary(1, one), sweep_summary(4, four)])
    assert rows[0]["rollout_tokens_per_s"] == pytest.approx(105.0), "the median of the steps after the first"
    assert rows[1]["rollout_tokens_per_s"] == pytest.approx(370.0) and rows[1]["step_s"] == pytest.approx(3.5)
    assert rows[1]["efficiency"] == pytest.approx(370.0 / 4 / 105.0) and rows[0]["efficiency"] == pytest.approx(1.0)
    assert (rows[0]["trained"], rows[0]["lost"], rows[1]["duplicated"]) == (47, 1, 2)
    table = sweep_table(rows)
    assert "| 4 | 3 | 370 | 0.88 | 3.50 | 0.65 | 48 | 0 | 2 |" in table
    assert "| 1 | 4 | 360 | 3.00 | 16 | 0 | 1 | 2 |" in resize_table(four)


def test_refusals(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["resize", "--sizes", "2", "--out-dir", str(tmp_path)])
    assert exit_info.value.code == 2 and "give the starting size and at least one more" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["sweep", "--rollout", "0", "2", "--out-dir", str(tmp_path)])
    assert "must all be >= 1" in capsys.readouterr().err


def test_a_job_at_its_wall_cap_is_described_then_interrupted():
    """The resize on 4 x H200 stalled until the wall cap; what the pool looked like then is now recorded."""
    described = []
    start = time.monotonic()
    code = _run([sys.executable, "-c", "import time; time.sleep(60)"], 0.5, 10.0, at_cap=lambda: described.append(1))
    assert described == [1] and code != 0 and time.monotonic() - start < 20
