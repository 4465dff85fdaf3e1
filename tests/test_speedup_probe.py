"""The speedup probe times warm passes only: each mode runs once untimed on an engine before its first timed pass."""

from sparrow.coordinator.speedup_probe import measure_speedup
from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine, NativeEngineConfig
from sparrow.schedule import SparsitySchedule


class RecordingEngine(NativeEngine):
    """The real engine, noting the mode of every generate call."""

    def __init__(self, config):
        super().__init__(config)
        self.calls: list[str] = []

    def generate(self, requests, progress=False):
        self.calls.append("dense" if self.schedule is None else "sparse")
        return super().generate(requests, progress)


def _requests():
    sampling = SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=3, ignore_eos=True)
    return [RolloutRequest(f"p{i}", tuple(range(5 + i, 90 + i)), sampling) for i in range(2)]


def test_first_probe_of_each_mode_runs_it_once_untimed_and_later_probes_do_not(tiny_qwen3):
    engine = RecordingEngine(NativeEngineConfig(model=str(tiny_qwen3), max_model_len=256, max_num_seqs=4, num_kv_blocks=64))
    schedule = SparsitySchedule(name="two", topk_blocks=(2,), edges=())
    engine.set_schedule(schedule)
    warmed: set[str] = set()
    first = measure_speedup(engine, _requests(), warmed)
    assert engine.calls == ["sparse", "sparse", "dense", "dense"] and warmed == {"sparse", "dense"}
    second = measure_speedup(engine, _requests(), warmed)
    assert engine.calls[4:] == ["sparse", "dense"], "warm modes are timed at once"
    assert engine.schedule.name == "two", "the probe restores the schedule in force"
    for result in (first, second):
        assert result.sparse_tokens_per_s > 0 and result.dense_tokens_per_s > 0


def test_a_dense_engine_warms_once_and_times_dense_twice(tiny_qwen3):
    engine = RecordingEngine(NativeEngineConfig(model=str(tiny_qwen3), max_model_len=256, max_num_seqs=4, num_kv_blocks=64))
    warmed: set[str] = set()
    measure_speedup(engine, _requests(), warmed)
    assert engine.calls == ["dense", "dense", "dense"] and warmed == {"dense"} and engine.schedule is None
