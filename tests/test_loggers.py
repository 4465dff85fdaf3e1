"""Experiment tracking (coordinator/loggers): real `StepRecord`s through jsonl, TensorBoard and W&B
(offline), read back with each tool's own reader; config errors naming the key, value and fix."""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from records import TOKENS_PER_BIN, make_record

from sparrow.coordinator.config import ConfigError, load_config
from sparrow.coordinator.loggers import open_loggers, step_scalars
from sparrow.coordinator.run_dir import RunDir
from sparrow.coordinator.step_record import StepRecord


RECORDS = [make_record(k) for k in range(3)]


def job(tmp_path: Path, *overrides: str):
    config = load_config(None, ["run.steps=3", *overrides])
    return config, RunDir.create(tmp_path, "run")


def log_all(config, run_dir: RunDir) -> None:
    loggers = open_loggers(config, run_dir)
    for record in RECORDS:
        loggers.log_step(record)
    loggers.close()


def jsonl_value(line: dict, tag: str):
    """Where a scalar's value sits in a metrics.jsonl line (the mapping docs/tracking.md documents)."""
    special = {"policy/version": line["policy_version"], "speedup/predicted": line["predicted_speedup"],
               "speedup/measured": line["rollout"]["speedup_measured"], "faults/count": len(line["faults"])}
    if tag in special:
        return special[tag]
    section, field, *key = tag.split("/", 2)
    if section == "train":
        return line["train"][tag]
    if (section, field) == ("schedule", "dense"):
        return int(line["schedule"]["blocks"][int(key[0].removeprefix("bin"))] is None)
    value = line[section][field]
    if not key:
        return value
    return value[int(key[0].removeprefix("bin"))] if key[0].startswith("bin") else value[key[0]]


def nulls(value):
    """NaN as metrics.jsonl writes it (null)."""
    if isinstance(value, dict):
        return {k: nulls(v) for k, v in value.items()}
    if isinstance(value, list):
        return [nulls(v) for v in value]
    return None if isinstance(value, float) and math.isnan(value) else value


def test_step_scalars_are_the_records_numbers_by_bin_and_worker():
    s0, s1, s2 = (step_scalars(r) for r in RECORDS)
    r = RECORDS[2]
    assert s2["rollout/reward_mean"] == r.rollout.reward_mean == 0.625  # 5 of 8 correct
    assert s2["rollout/accuracy"] == 0.625 and s2["rollout/tokens"] == 1254 and s2["rollout/tokens_per_s"] == 1254 / 6.5
    assert s2["rollout/kv_read_fraction"] == pytest.approx(0.6) and s2["rollout/requeued"] == 1.0
    assert s2["rollout/utilisation/rollout-0"] == pytest.approx(0.91)
    assert s2["rollout/utilisation/rollout-1"] == pytest.approx(0.71)
    assert s2["rollout/groups/rollout-0"] == 1.0
    assert s2["train/pg_loss"] == pytest.approx(-0.036) and s2["train/grad_norm"] == pytest.approx(0.55)
    assert "train/grad_norm" not in s0  # NaN: metrics.jsonl writes null
    for b in range(3):
        assert s2[f"alpha/p5/bin{b}"] == r.alpha.p5[b] and s2[f"alpha/p5_upper/bin{b}"] == r.alpha.p5_upper[b]
        assert 0.75 < s2[f"alpha/p5/bin{b}"] < s2[f"alpha/p5_upper/bin{b}"] < 1.0
        assert s2[f"alpha/tokens/bin{b}"] == TOKENS_PER_BIN[b] and s2[f"schedule/dense/bin{b}"] == 0.0
    assert s2["alpha/tokens/bin3"] == 0.0 and "alpha/p5/bin3" not in s2 and "alpha/mean/bin3" not in s2
    assert not any(tag.startswith("alpha/p5_exact") for tag in s2)  # trainer.exact_alpha was off
    exact = dataclasses.replace(r.alpha, p5=[0.9, 0.88, 0.87, None], p5_upper=None)
    s3 = step_scalars(dataclasses.replace(r, alpha_exact=exact))
    assert [s3.get(f"alpha/p5_exact/bin{b}") for b in range(4)] == [0.9, 0.88, 0.87, None]
    # blocks = top-k + sink 1 + recent 2; the dense bin has no budget, only the dense flag
    assert [s2.get(f"schedule/blocks/bin{b}") for b in range(4)] == [6.0, 7.0, 10.0, None]
    assert s2["schedule/dense/bin3"] == 1.0 and s2["schedule/version"] == 2.0 and s2["controller/changes"] == 1.0
    assert s2["speedup/predicted"] == pytest.approx(1.52) and s2["speedup/measured"] == pytest.approx(1.33)
    assert "speedup/measured" not in s1  # no dense probe at odd steps
    assert s2["publish/seconds"] == pytest.approx(1.0) and s2["publish/bytes"] == 538e6
    assert s2["timing/step"] == 20.5 and s2["timing/elapsed"] == 49.5
    assert (s0["faults/count"], s2["faults/count"]) == (0.0, 1.0)
    assert all(type(v) is float and math.isfinite(v) for s in (s0, s1, s2) for v in s.values())
    assert {tag.split("/")[0] for tag in s2} == {"policy", "rollout", "train", "alpha", "schedule", "controller", "speedup",
                                                 "publish", "timing", "faults"}


def test_jsonl_is_the_metrics_line_and_holds_the_same_scalars(tmp_path):
    config, run_dir = job(tmp_path)  # run.loggers defaults to [jsonl]
    assert config.run.loggers == ["jsonl"]
    log_all(config, run_dir)
    lines = [json.loads(line) for line in run_dir.metrics_file.read_text().splitlines()]
    assert lines == [nulls(r.to_dict()) for r in RECORDS]
    assert lines[0]["train"]["train/grad_norm"] is None
    for line, record in zip(lines, RECORDS):
        assert StepRecord.from_dict(line).alpha == record.alpha
        for tag, value in step_scalars(record).items():
            assert jsonl_value(line, tag) == value, tag
    assert sorted(p.name for p in run_dir.path.iterdir()) == ["metrics.jsonl"]


def test_tensorboard_event_files_hold_every_scalar_at_its_step(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config, run_dir = job(tmp_path, "run.loggers=[jsonl, tensorboard]")
    log_all(config, run_dir)
    assert len(run_dir.metrics_file.read_text().splitlines()) == 3
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    logged = {}
    for record in RECORDS:
        for tag, value in step_scalars(record).items():
            logged.setdefault(tag, []).append((record.step, np.float32(value)))
    assert set(events.Tags()["scalars"]) == set(logged)
    for tag, points in logged.items():
        assert [(e.step, np.float32(e.value)) for e in events.Scalars(tag)] == points, tag
    assert [e.step for e in events.Scalars("speedup/measured")] == [0, 2]
    assert [e.step for e in events.Scalars("train/grad_norm")] == [1, 2]
    assert [e.value for e in events.Scalars("schedule/dense/bin3")] == [1.0, 1.0, 1.0]


def test_tensorboard_of_a_resumed_run_shows_the_redone_steps_only(tmp_path):
    """--resume from a step-1 checkpoint redoes steps 1 and 2: their first events are hidden (purge_step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config, run_dir = job(tmp_path, "run.loggers=[jsonl, tensorboard]")
    log_all(config, run_dir)
    redone = make_record(1)
    redone.rollout.reward_mean = 0.25
    loggers = open_loggers(config, run_dir)
    loggers.log_step(redone)
    loggers.close()
    events = EventAccumulator(str(run_dir.tensorboard_dir), size_guidance={"scalars": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("rollout/reward_mean")] == [(0, 0.625), (1, 0.25)]


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    """W&B's per-user files in a scratch home; were anything to dial out, it would reach a closed loopback port."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)


def inspect_wandb(run_file: Path) -> list[dict]:
    """The records of a .wandb transaction log, decoded by wandb's own reader (`wandb leet inspect --json`)."""
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
                         capture_output=True, text=True, timeout=120, check=True, stdin=subprocess.DEVNULL)
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_wandb_offline_run_holds_the_config_and_one_history_row_per_step(tmp_path, wandb_env):
    config, run_dir = job(tmp_path, "run.loggers=[jsonl, wandb]", "run.wandb.tags=[smoke]")
    assert config.run.wandb.mode == "offline"
    log_all(config, run_dir)
    (run_file,) = (run_dir.path / "wandb").glob("offline-run-*/run-*.wandb")
    records = inspect_wandb(run_file)
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert (run["project"], run["display_name"], run["tags"]) == ("sparrow", "run", ["smoke"])
    stored = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
    assert stored == config.model_dump(mode="json")
    history = [r["history"] for r in records if r["type"] == "history"]
    assert [h["step"]["num"] for h in history] == [0, 1, 2]
    for h, record in zip(history, RECORDS):
        assert {k: v for k, v in h["item"].items() if not k.startswith("_")} == step_scalars(record)
    assert [r for r in records if r["type"] == "exit"][0]["exit"].get("exit_code", 0) == 0
    core_log = (run_file.parent / "logs" / "debug-core.log").read_text()
    assert "graphql" not in core_log and "dial tcp" not in core_log  # offline: nothing was sent anywhere


ONLINE = """
import sys
from sparrow.coordinator.config import ConfigError, load_config
from sparrow.coordinator.loggers import open_loggers
from sparrow.coordinator.run_dir import RunDir
config = load_config(None, ["run.loggers=[jsonl,wandb]", "run.wandb.mode=online", "run.wandb.init_timeout_s=1"])
try:
    open_loggers(config, RunDir.create(sys.argv[1], "run"))
except ConfigError as exc:
    print(exc)
"""


@pytest.mark.parametrize("api_key, expected", [
    (None, ["run.wandb.mode='online' needs a W&B API key and none is configured"]),
    ("x" * 86, ["run.wandb.mode='online': W&B could not start the run within init_timeout_s=1.0 (",
                "http://127.0.0.1:9/graphql", "connection refused", "check the network and WANDB_BASE_URL"]),
], ids=["no API key", "server unreachable"])
def test_wandb_online_without_a_key_or_the_network_is_refused_naming_the_fix(tmp_path, api_key, expected):
    """In a fresh process each: W&B keeps a login and the server address per process."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), WANDB_BASE_URL="http://127.0.0.1:9", WANDB_SILENT="true",
               **({"WANDB_API_KEY": api_key} if api_key else {}))
    out = subprocess.run([sys.executable, "-c", ONLINE, str(tmp_path)], capture_output=True, text=True, timeout=120,
                         env=env, stdin=subprocess.DEVNULL)
    assert all(part in out.stdout for part in expected), out.stdout + out.stderr
    assert "upload RUN_DIR/wandb/offline-run-* later with `wandb sync`" in out.stdout


@pytest.mark.parametrize("logger, module", [("tensorboard", "torch.utils.tensorboard"), ("wandb", "wandb")])
def test_a_missing_tracking_package_names_the_extra(tmp_path, monkeypatch, logger, module):
    monkeypatch.setitem(sys.modules, module, None)  # what `import` does when the package is not installed
    config, run_dir = job(tmp_path, f"run.loggers=[jsonl, {logger}]")
    with pytest.raises(ConfigError, match=rf"run.loggers has '{logger}' but {module} cannot be imported .*install "
                                          rf"Sparrow's tracking extra \(bash deploy/setup.sh --tracking"):
        open_loggers(config, run_dir)


@pytest.mark.parametrize("overrides, expected", [
    (["run.loggers=[jsonl, mlflow]"], "run.loggers[1]: Input should be 'jsonl', 'tensorboard' or 'wandb' (got 'mlflow')"),
    (["run.loggers=[jsonl, tensorboard, tensorboard]"],
     "run: loggers=['jsonl', 'tensorboard', 'tensorboard'] lists 'tensorboard' more than once; list each logger once"),
    (["run.loggers=[wandb]"], "run: loggers=['wandb'] leaves out 'jsonl': the report (RUN_DIR/report/) is made from "
                              "RUN_DIR/metrics.jsonl; add 'jsonl'"),
    (["run.wandb.project=rl"], "run: wandb is set ({'project': 'rl'}) but loggers=['jsonl'] has no 'wandb'; add 'wandb' "
                               "to loggers or remove the wandb section"),
    (["run.loggers=[jsonl, wandb]", "run.wandb.mode=cloud"],
     "run.wandb.mode: Input should be 'offline' or 'online' (got 'cloud')"),
    (["run.loggers=[jsonl, wandb]", "run.wandb.projct=rl"], "run.wandb.projct: unknown key; did you mean 'run.wandb.project'?"),
])
def test_logger_config_errors_name_key_value_and_fix(overrides, expected):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert expected in str(info.value)


def test_logger_config_round_trips_through_the_run_directorys_config(tmp_path):
    config = load_config(None, ["run.loggers=[jsonl, tensorboard, wandb]", "run.wandb.group=sweep-1"])
    (tmp_path / "config.yaml").write_text(config.dump())
    assert load_config(tmp_path / "config.yaml") == config
