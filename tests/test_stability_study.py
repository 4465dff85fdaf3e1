"""benchmarks/stability_study.py: the arms' overrides on the GPU study config, and one arm run for 2 steps with the
tiny model through real Ray, gRPC and DeepSpeed (a `sparrow train` subprocess), then merged into a table and plots."""

import json
import sys
from pathlib import Path

import pytest
from jobs import tiny_job

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

from stability.arms import arm_overrides, covering_topk  # noqa: E402
from stability.summary import exact_row, in_band, steps_to_band  # noqa: E402
from stability_study import main  # noqa: E402

from sparrow.coordinator.config import load_config  # noqa: E402

GPU_CONFIG = Path(__file__).resolve().parents[1] / "deploy/configs/smollm2-longctx-h200.yaml"

SETTINGS = {
    "data.eval": {"prompts": 2}, "rollout.sampling": {"max_tokens": 12, "n": 4, "temperature": 1.0},
    "rollout.speedup_probe_every": 2, "run.prompts_per_step": 2, "run.mode": "async",
}


def _arm(arm: str) -> tuple:
    config = load_config(GPU_CONFIG, arm_overrides(arm, load_config(GPU_CONFIG).initial_schedule(), 0.86,
                                                   load_config(GPU_CONFIG).controller.ladder, 8192, 8))
    return config.controller.enabled, config.initial_schedule(), config.schedule_template().edges


def test_each_arm_keeps_the_bins_and_sets_controller_and_schedule():
    edges = (3072, 4096, 5120, 6144)
    assert _arm("a") == (False, None, edges)
    enabled, schedule, bins = _arm("b")
    assert (enabled, schedule.topk_blocks, bins) == (True, (61, 93, 125, 125, 157), edges)
    assert _arm("c")[1].topk_blocks == (8,) * 5 and not _arm("c")[0]
    assert _arm("d1")[1].topk_blocks == (29,) * 5 and _arm("d1")[0]
    assert _arm("d2")[1].topk_blocks == (189, 253, 317, 381, 509) and _arm("d2")[0]


def test_too_large_schedule_covers_each_bins_longest_context():
    schedule = load_config(GPU_CONFIG).initial_schedule()
    ladder = load_config(GPU_CONFIG).controller.ladder
    for end, topk in zip([3072, 4096, 5120, 6144, 8192], covering_topk(schedule, 8192, ladder)):
        assert (topk + schedule.sink + schedule.recent) * schedule.block_size >= end


def test_unknown_arm_and_dense_config_are_refused_with_the_fix():
    schedule = load_config(GPU_CONFIG).initial_schedule()
    with pytest.raises(ValueError, match="unknown arm; pick one of a, b, c, d1, d2"):
        arm_overrides("e", schedule, 0.86, [1, 2], 8192, 8)
    with pytest.raises(ValueError, match="needs a sparse schedule"):
        arm_overrides("b", None, 0.86, [1, 2], 8192, 8)


def test_convergence_is_the_first_step_with_every_measured_bin_in_band():
    assert in_band([0.87, None, 0.86], 0.86) and not in_band([0.87, 0.85], 0.86) and not in_band([None], 0.86)
    arm = {"tau": 0.86, "steps": [{"p5_alpha": [0.80, 0.9]}, {"p5_alpha": [0.87, 0.95]}, {"p5_alpha": [0.861, 0.879]}]}
    assert steps_to_band(arm) == 3
    assert steps_to_band({"tau": 0.86, "steps": [{"p5_alpha": [0.5]}]}) is None
    assert steps_to_band(arm, band=None) == 2


def test_the_midpoint_reading_averages_each_bins_bounds():
    arm = {"tau": 0.86, "steps": [{"p5_alpha": [0.84, None], "p5_alpha_upper": [0.90, None]},
                                  {"p5_alpha": [0.80, 0.85], "p5_alpha_upper": [0.90, 0.88]}]}
    assert steps_to_band(arm, "midpoint") == 1 and steps_to_band(arm, "lower") is None
    assert steps_to_band(arm, "midpoint", band=0.005) is None


def test_the_exact_reading_and_its_row_beside_the_bounds():
    """trainer.exact_alpha's p5 per bin: its own convergence reading, and how far the bounds sit from it."""
    timing = {"policy_update_s": 30.0, "exact_alpha_s": 40.0}
    steps = [dict(timing, p5_alpha=[0.80, 0.70], p5_alpha_upper=[0.92, 0.90], p5_alpha_exact=[0.90, 0.86],
                  distill_s=65.0, distill_kl=0.15),
             dict(timing, p5_alpha=[0.84, 0.80], p5_alpha_upper=[0.88, 0.86], p5_alpha_exact=[0.87, 0.865],
                  distill_s=61.0, distill_kl=0.12)]
    arm = {"label": "b-distill", "tau": 0.86, "steps": steps}
    assert steps_to_band(arm, "exact", band=None) == 1 and steps_to_band(arm, "exact") == 2
    assert steps_to_band(arm, "lower", band=None) is None
    assert exact_row(arm) == ["b-distill", "0.870 0.865", "0.089", "0.016", "1/2", "30.0", "40.0", "63.0", "0.150 0.120"]
    assert steps_to_band({"tau": 0.86, "steps": [{"p5_alpha": [0.9]}]}, "exact", band=None) is None  # not measured


def test_a_set_that_would_replace_an_arms_key_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--arm", "c", "--config", str(GPU_CONFIG), "--out-dir", str(tmp_path),
              "--set", "rollout.schedule={name: x, edges: [3072, 4096, 5120, 6144], topk_blocks: [4, 4, 4, 4, 4]}"])
    assert "--set rollout.schedule: the arm sets this key" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--arm", "a", "--config", str(GPU_CONFIG), "--out-dir", str(tmp_path), "--set", "run.steps=3"])
    assert "--set run.steps: the study sets this key" in capsys.readouterr().err


def test_a_label_that_cannot_name_a_file_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--arm", "b", "--label", "b/top64", "--out-dir", str(tmp_path)])
    assert "--label 'b/top64': use letters, digits" in capsys.readouterr().err


@pytest.mark.slow
def test_one_arm_runs_two_steps_and_merges(tiny_qwen3, tmp_path):
    config = tiny_job(tmp_path / "job.yaml", tiny_qwen3, None, SETTINGS)
    out = tmp_path / "study"
    main(["--arm", "b", "--config", str(config), "--steps", "2", "--out-dir", str(out), "--max-wall-s", "240"])
    arm = json.loads((out / "arm-b.json").read_text())
    assert [s["step"] for s in arm["steps"]] == [0, 1] and not arm["wall_capped"] and arm["returncode"] == 0
    assert arm["command"][1:4] == ["-m", "sparrow.cli.main", "train"] and "controller.enabled=true" in arm["command"]
    assert arm["eval_dense_before"]["policy_version"] == 0 and arm["eval_dense_after"]["policy_version"] == 2
    assert arm["steps"][0]["rollout_s"] > 0 and arm["steps"][0]["speedup_measured"] > 0
    assert len(arm["steps"][0]["p5_alpha"]) == 3 and len(arm["steps"][0]["topk_blocks"]) == 3

    merged = tmp_path / "merged"
    main(["--merge", str(out / "arm-b.json"), "--out-dir", str(merged)])
    results = json.loads((merged / "stability.json").read_text())
    assert results["table"].splitlines()[2].startswith("| b | 2 |")
    assert all((merged / name).stat().st_size > 0 for name in results["plots"])


@pytest.mark.slow
def test_an_arm_at_its_wall_cap_keeps_the_steps_it_finished(tiny_qwen3, tmp_path):
    """The arm JSON is written before the job is interrupted (a GPU call's own time limit can end the study while
    the job shuts down) and again after; both say the arm was capped."""
    config = tiny_job(tmp_path / "job.yaml", tiny_qwen3, None, SETTINGS)
    out = tmp_path / "study"
    main(["--arm", "c", "--label", "c-capped", "--config", str(config), "--steps", "500", "--out-dir", str(out),
          "--max-wall-s", "30", "--grace-s", "30"])
    arm = json.loads((out / "arm-c-capped.json").read_text())
    assert (arm["arm"], arm["label"]) == ("c", "c-capped") and "run.name=arm-c-capped" in arm["command"]
    assert arm["wall_capped"] and 1 <= len(arm["steps"]) < 500, len(arm["steps"])
    assert arm["eval_dense_before"]["policy_version"] == 0 and arm["eval_dense_after"] is None
