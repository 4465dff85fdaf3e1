"""The `RolloutEngine` contract: backends by name without importing them, what every engine answers
(layout, schedule check, counters, weights), the one-call-at-a-time rule, and one weight or schedule
change at a time."""

import subprocess
import sys
import threading

import pytest

from sparrow.layout import SparseAttentionConfig
from sparrow.rollout_workers import registry
from sparrow.rollout_workers.api import EngineCounters, RolloutEngine, RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine, NativeEngineConfig
from sparrow.rollout_workers.vllm_backend import VllmEngineConfig
from sparrow.schedule import ScheduleError, SparsitySchedule


def test_registry_imports_no_engine_until_asked():
    code = ("import sys; from sparrow.rollout_workers import registry; "
            "print(sorted(m for m in ('vllm', 'sparrow.rollout_workers.native.engine') if m in sys.modules), registry.names())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[] ['native', 'vllm']"


def test_registry_lookup_and_errors(tiny_qwen3):
    assert registry.engine_class("native") is NativeEngine and registry.config_class("vllm") is VllmEngineConfig
    with pytest.raises(ValueError, match="rollout engine 'sglang': not registered; registered: native, vllm"):
        registry.engine_class("sglang")
    with pytest.raises(TypeError, match="takes a NativeEngineConfig, got VllmEngineConfig"):
        registry.create_engine("native", VllmEngineConfig(model=str(tiny_qwen3)))
    engine = registry.create_engine("native", NativeEngineConfig(model=str(tiny_qwen3), num_kv_blocks=8))
    assert isinstance(engine, NativeEngine) and engine.max_concurrent_samples == 64


def test_what_the_worker_reads_is_on_the_contract(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=32, sink=2)
    assert engine.layout.sink == 2
    with pytest.raises(ScheduleError, match="sink=1 but the engine uses sink=2"):
        engine.check_schedule(SparsitySchedule(name="s", topk_blocks=(2,), edges=()))
    engine.check_schedule(None)
    weights = engine.parameters(["model.norm.weight"])
    assert weights["model.norm.weight"].device.type == "cpu"
    request = RolloutRequest("r", tuple(range(5, 25)), SamplingParams(max_tokens=4, ignore_eos=True, n=2, seed=1))
    engine.generate([request])
    counters = engine.counters()
    assert (counters.tokens_generated, counters.samples_finished, counters.samples_failed, counters.samples_running) == (8, 2, 0, 0)
    engine.shutdown()


def test_the_base_refuses_what_a_backend_does_not_serve():
    class Minimal(RolloutEngine):
        generate = stream = abort = counters = stats = max_concurrent_samples = _load_weights = _set_schedule = None

    engine = Minimal(SparseAttentionConfig())
    with pytest.raises(NotImplementedError, match="Minimal does not expose its weights"):
        engine.parameters(["x"])
    with pytest.raises(NotImplementedError, match="Minimal cannot recompute logprobs teacher-forced"):
        engine.prompt_scorer([1, 2, 3])
    engine.shutdown()  # nothing to release


def test_one_generate_or_stream_at_a_time(tiny_qwen3):
    engine = NativeEngine.from_pretrained(tiny_qwen3, num_kv_blocks=32)
    with engine._serving_call():
        with pytest.raises(RuntimeError, match="already serving a generate/stream call"):
            engine.generate([RolloutRequest("r", (5, 6, 7))])
    assert len(engine.generate([RolloutRequest("r", (5, 6, 7), SamplingParams(max_tokens=2))])) == 1


def test_a_schedule_change_waits_for_a_weight_change_in_progress():
    """vLLM on CPU restarts itself to take new weights: a schedule sent to the engine it is stopping was never
    answered (a joining worker's `serve` set its schedule while the job's publication restarted it, and hung)."""
    swapping, release = threading.Event(), threading.Event()
    calls: list[str] = []

    class Restarting(RolloutEngine):
        generate = stream = abort = stats = max_concurrent_samples = None

        def counters(self):
            return EngineCounters(0, 0, 0, 0)

        def _load_weights(self, weights, version):
            calls.append("restart begins")
            swapping.set()
            release.wait(timeout=10)
            calls.append("restart ends")

        def _set_schedule(self, schedule):
            calls.append(f"schedule {schedule.name}")
            self._schedule = schedule

    engine = Restarting(SparseAttentionConfig())
    loader = threading.Thread(target=engine.load_weights, args=({}, 1))
    loader.start()
    assert swapping.wait(timeout=10)
    setter = threading.Thread(target=engine.set_schedule, args=(SparsitySchedule(name="s", topk_blocks=(2,), edges=()),))
    setter.start()
    setter.join(timeout=0.5)
    assert setter.is_alive() and calls == ["restart begins"]
    release.set()
    loader.join(timeout=10)
    setter.join(timeout=10)
    assert calls == ["restart begins", "restart ends", "schedule s"]
    assert (engine.policy_version, engine.schedule_version) == (1, 0)
