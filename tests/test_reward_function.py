"""`reward.function`: a user's reward function, validated at config load and called in isolation.

The functions are real ones in tests/reward_functions.py, imported by name as a user's module is.
The last test runs a real `RolloutWorker` (native engine, tiny model) against a real trajectory
server, without Ray.
"""

import logging
import threading
import time

import pytest
import torch

import reward_functions
from sparrow.coordinator.config import ConfigError, RewardConfig, load_config
from sparrow.coordinator.data import PromptRecord, PromptSource
from sparrow.coordinator.metrics import SparrowMetrics
from sparrow.coordinator.rewards import RewardFunction, reward_metadata

RECORD = PromptRecord("s3-p1", ({"role": "user", "content": "Calculate 2 + 5."},), "7", index=19)


def reward(name: str, **kw) -> tuple[RewardFunction, list[str]]:
    errors: list[str] = []
    fn = RewardFunction(RewardConfig(function=f"reward_functions:{name}", **kw), "jsonl", on_error=errors.append)
    return fn, errors


def call(fn: RewardFunction, text: str, finish_reason: str = "stop", sample_index: int = 0) -> float:
    return fn(text, RECORD.answer, finish_reason, reward_metadata(RECORD, 3, sample_index, finish_reason, f"s3-p1#{sample_index}"))


@pytest.fixture(scope="module", autouse=True)
def release_hanging_calls():
    yield
    reward_functions.release.set()


def test_sync_and_async_functions_get_text_answer_and_metadata():
    sync, errors = reward("contains_answer")
    assert sync.kind == "function"
    assert call(sync, "so the result is 7") == 1.0 and call(sync, "it is 8") == 0.0
    assert call(sync, "7 and then", "length") == 1.5
    asynchronous, _ = reward("async_length")
    assert call(asynchronous, "x" * 250, sample_index=2) == 4.5
    assert errors == []
    meta = reward_metadata(RECORD, 3, 2, "stop", "s3-p1#2")
    assert meta == {
        "prompt_id": "s3-p1", "messages": [{"role": "user", "content": "Calculate 2 + 5."}], "answer": "7", "index": 19,
        "step": 3, "sample_index": 2, "sample_id": "s3-p1#2", "finish_reason": "stop",
    }


def test_truncated_still_overrides_a_function():
    fn, _ = reward("contains_answer", truncated=-1.0)
    assert call(fn, "7", "length") == -1.0 and call(fn, "7", "stop") == 1.0


def test_failures_score_on_error_are_logged_and_counted(caplog):
    metrics = SparrowMetrics.for_rollout(None, 0)
    got = {}
    with caplog.at_level(logging.WARNING, logger="sparrow.coordinator.rewards"):
        for name in ("raises", "hangs", "async_hangs", "returns_nan", "returns_text"):
            fn = RewardFunction(
                RewardConfig(function=f"reward_functions:{name}", timeout_s=0.5, on_error=-1.0), "jsonl",
                on_error=metrics.record_reward_error,
            )
            start = time.perf_counter()
            got[name] = (call(fn, "7", sample_index=1), time.perf_counter() - start)
    assert {name: value for name, (value, _) in got.items()} == dict.fromkeys(got, -1.0)
    assert got["hangs"][1] < 3 and got["async_hangs"][1] < 3  # the worker waits timeout_s (0.5 s), not the 30 s they take
    counts = {s.labels["reason"]: s.value for m in metrics.registry.collect() if m.name == "sparrow_reward_errors"
              for s in m.samples if s.name.endswith("_total")}
    assert counts == {"exception": 1.0, "timeout": 2.0, "invalid": 2.0}
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 5 and all("sample s3-p1#1" in m and "scored -1" in m for m in messages)
    assert "KeyError: 'no verifier for s3-p1'" in messages[0] and caplog.records[0].exc_info is not None
    assert "no result after reward.timeout_s=0.5 s" in messages[1] and "no result after" in messages[2]
    assert "returned nan, not a finite number" in messages[3] and "returned str '1.0', not a number" in messages[4]


def test_a_stuck_function_is_not_started_again_after_max_abandoned(monkeypatch):
    from sparrow.coordinator import user_reward

    monkeypatch.setattr(user_reward, "MAX_ABANDONED", 2)
    fn, errors = reward("hangs", timeout_s=0.05)
    values = [call(fn, "7") for _ in range(4)]
    assert values == [0.0] * 4 and errors == ["timeout"] * 4
    assert len(fn.user.abandoned) == 2  # calls 3 and 4 were refused without starting a thread


@pytest.mark.parametrize("spec, message", [
    ("reward_functions", 'expected "package.module:function"'),
    ("no_such_module_xyz:score", "cannot import module 'no_such_module_xyz' (ModuleNotFoundError"),
    ("reward_functions:missing", "module 'reward_functions' has no attribute 'missing' (callables there: "),
    ("reward_functions:NOT_A_FUNCTION", "reward_functions:NOT_A_FUNCTION is a int, not a function"),
    ("reward_functions:two_parameters", "cannot be called as fn(text, answer, metadata)"),
])
def test_bad_function_is_refused_at_config_load(spec, message):
    with pytest.raises(ConfigError) as exc:
        load_config(overrides=[f"reward.function={spec}"])
    line = next(line for line in str(exc.value).splitlines() if line.startswith("reward.function: "))
    assert message in line and line.endswith(f"(got {spec!r})")


def test_function_settings_that_would_be_ignored_are_refused():
    with pytest.raises(ConfigError, match="would be ignored; remove them"):
        load_config(overrides=["reward.function=reward_functions:contains_answer", "reward.correct=2"])
    with pytest.raises(ConfigError, match="reward: timeout_s apply to a reward function only"):
        load_config(overrides=["reward.timeout_s=5"])
    config = load_config(overrides=["reward.function=reward_functions:contains_answer", "reward.on_error=-1"])
    assert (config.reward.function, config.reward.timeout_s, config.reward.on_error) == ("reward_functions:contains_answer", 30.0, -1.0)


def test_rollout_worker_scores_with_the_function_and_survives_its_failures(tiny_qwen3):
    """The worker's own path: lease → generate → decode → reward(text, answer, metadata) → send → complete."""
    from transformers import AutoTokenizer

    from sparrow.coordinator.dispatcher import Dispatcher
    from sparrow.coordinator.fleet import WorkerSetup
    from sparrow.coordinator.rollout_worker import RolloutWorker
    from sparrow.coordinator.transport import JobCredentials, TrajectoryServer

    config = load_config(overrides=[
        f"model={tiny_qwen3}", "reward.function=reward_functions:flaky", "reward.on_error=-2", "metrics.enabled=false",
        "rollout.native={max_num_seqs: 8, max_model_len: 256, num_kv_blocks: 64}", "rollout.speedup_probe_every=0",
        "rollout.sampling={max_tokens: 6, n: 2}",
    ])
    records = PromptSource(config.data, seed=0).batch(0, 2)
    credentials = JobCredentials.create(config.transport)
    worker = RolloutWorker(config.worker_payload(), str(tiny_qwen3), 0, torch.get_num_threads(), credentials)
    dispatcher = Dispatcher(max_staleness=0, lease_timeout_s=60)
    dispatcher.add_step(0, records, [])
    try:
        with TrajectoryServer(config.transport, credentials) as server:
            setup = WorkerSetup(server.address, config.schedule_template(), None)  # as the fleet starts a worker
            serving = threading.Thread(target=worker.serve, args=(dispatcher, setup))
            serving.start()
            deadline = time.monotonic() + 120
            while not dispatcher.progress(0)[2] and time.monotonic() < deadline:
                time.sleep(0.05)
            worker.stop()
            serving.join()
            received = {t.sample_id: t for t in server.get_batch(4, timeout=5)}
            counts = {s.labels["reason"]: s.value for m in worker.metrics.registry.collect()
                      if m.name == "sparrow_reward_errors" for s in m.samples if s.name.endswith("_total")}
    finally:
        worker.shutdown()
    reports = [report for _, report in dispatcher.take_step(0).done.values()]
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)
    assert sum(r.samples for r in reports) == 4 and sum(r.accepted for r in reports) == 4 and len(received) == 4
    for r in records:
        first, second = received[f"{r.prompt_id}#0"], received[f"{r.prompt_id}#1"]
        text = tokenizer.decode(first.sample.token_ids.tolist(), skip_special_tokens=True)
        assert first.reward == pytest.approx(len(text) / 100) and second.reward == -2.0
    assert counts == {"exception": 2.0}
