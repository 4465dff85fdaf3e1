"""The registry is the only list of rollout backends: a new one is its package and one `register` call.

A throwaway backend (the native engine under another name, with a field and a job rule of its own) is
registered here and then configured, validated, documented and built through the job's own paths, with no
edit anywhere else; a package outside the repository does the same through its entry point.
"""

import subprocess
import sys
import textwrap

import pytest
from pydantic import Field

from sparrow.coordinator import config_docs
from sparrow.coordinator.config import ConfigError, load_config
from sparrow.rollout_workers import registry
from sparrow.rollout_workers.api import RolloutRequest, SamplingParams
from sparrow.rollout_workers.native import NativeEngine, NativeEngineConfig


class ToyEngineConfig(NativeEngineConfig):
    """The throwaway backend's section: the native engine's keys, one of its own and one more job rule."""

    greeting: str = Field("hello", min_length=1, description="toy backend: a key only this backend has")

    def check_job(self, sampling, schedule, section, name):
        super().check_job(sampling, schedule, section, name)
        if sampling.n > 2:
            raise ValueError(f"{section}.sampling.n={sampling.n}: the {name} backend serves groups of at most 2")


class ToyEngine(NativeEngine):
    """The native engine, registered under another name."""


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(registry._BACKENDS, "toy", registry.Backend(f"{__name__}:ToyEngine", f"{__name__}:ToyEngineConfig"))


def _error(overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    return str(info.value)


def test_a_registered_backend_is_configured_validated_documented_and_built(toy, tiny_qwen3):
    job = ["rollout.engine=toy", "rollout.sampling.n=2", "rollout.toy.max_num_seqs=4", "rollout.toy.greeting=hi"]
    config = load_config(None, job)
    section = config.rollout.engine_config()
    assert type(section) is ToyEngineConfig and config.rollout.toy is section
    assert (section.max_num_seqs, section.greeting) == (4, "hi")
    assert config.model_dump()["rollout"]["toy"]["greeting"] == "hi"  # what the workers get

    assert "rollout.toy.greeting: String should have at least 1 character" in _error(job + ["rollout.toy.greeting=''"])
    assert "rollout.toy.grteting: unknown key; did you mean 'rollout.toy.greeting'?" in _error(job + ["rollout.toy.grteting=x"])
    assert "rollout.sampling.n=4: the toy backend serves groups of at most 2" in _error(job[:1])
    assert "native, toy, vllm" in _error(["rollout.engine=sglang"])
    assert "| `rollout.toy.greeting` | `hello` | toy backend: a key only this backend has |" in config_docs.tables()

    engine = registry.create_engine("toy", section.model_copy(update={"model": str(tiny_qwen3), "num_kv_blocks": 32}))
    request = RolloutRequest("r", tuple(range(5, 25)), SamplingParams(max_tokens=3, ignore_eos=True, n=2, seed=1))
    samples = engine.generate([request])
    assert isinstance(engine, ToyEngine) and [len(s.token_ids) for s in samples] == [3, 3]
    engine.shutdown()


def test_an_installed_package_registers_its_backend_through_the_entry_point(tmp_path):
    """Every process (a Ray worker too) finds the backend of an installed package without importing it by hand."""
    (tmp_path / "toy_plugin.py").write_text(textwrap.dedent("""
        from sparrow.rollout_workers import registry

        def register():
            registry.register("toy", "sparrow.rollout_workers.native.engine:NativeEngine",
                              "sparrow.rollout_workers.native.config:NativeEngineConfig")
    """))
    info = tmp_path / "toy_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[sparrow.rollout_backends]\ntoy = toy_plugin:register\n")
    code = ("from sparrow.coordinator.config import load_config; "
            "c = load_config(None, ['rollout.engine=toy', 'rollout.toy.max_num_seqs=8']); "
            "print(type(c.rollout.engine_config()).__name__, c.rollout.toy.max_num_seqs)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(tmp_path), "PATH": ""}, cwd=tmp_path).stdout
    assert out.split() == ["NativeEngineConfig", "8"]


def test_partial_rollouts_that_resume_need_a_backend_that_interrupts(toy, monkeypatch):
    monkeypatch.setattr(ToyEngineConfig, "interrupts", False)
    job = ["rollout.engine=toy", "rollout.sampling.n=2", "run.partial_rollout.enabled=true"]
    assert ("run.partial_rollout.carry='resume' needs an engine that interrupts a sample and keeps its tokens; "
            "rollout.engine='toy' does not: set run.partial_rollout.carry='finish'") in _error(job)
    assert load_config(None, job + ["run.partial_rollout.carry=finish"]).run.partial_rollout.carry == "finish"
