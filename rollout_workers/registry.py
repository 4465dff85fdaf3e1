"""Rollout backends by name: what `rollout.engine` selects.

Each backend is registered as dotted paths to its engine and config classes and imported only when
looked up, so importing this module (or the job config) imports neither engine, and vLLM only when the
"vllm" backend is built. A new backend is one `register` call plus a `RolloutEngine` subclass.
"""

from dataclasses import dataclass
from importlib import import_module

from .api import RolloutEngine
from .engine_settings import EngineSettings


@dataclass(frozen=True)
class Backend:
    engine: str
    """`module:Class` of the `RolloutEngine`."""
    config: str
    """`module:Class` of its `EngineSettings` section."""


_BACKENDS: dict[str, Backend] = {}


def register(name: str, engine: str, config: str) -> None:
    _BACKENDS[name] = Backend(engine, config)


def names() -> list[str]:
    return sorted(_BACKENDS)


def _backend(name: str) -> Backend:
    if name not in _BACKENDS:
        raise ValueError(f"rollout engine {name!r}: not registered; registered: {', '.join(names())}")
    return _BACKENDS[name]


def _load(path: str) -> type:
    module, attr = path.split(":")
    return getattr(import_module(module), attr)


def engine_class(name: str) -> type[RolloutEngine]:
    return _load(_backend(name).engine)


def config_class(name: str) -> type[EngineSettings]:
    return _load(_backend(name).config)


def create_engine(name: str, config: EngineSettings) -> RolloutEngine:
    """The engine registered as `name`, built from its config section."""
    expected = config_class(name)
    if not isinstance(config, expected):
        raise TypeError(f"rollout engine {name!r} takes a {expected.__name__}, got {type(config).__name__}")
    return engine_class(name)(config)


register("native", "sparrow.rollout_workers.native.engine:NativeEngine", "sparrow.rollout_workers.native.config:NativeEngineConfig")
register("vllm", "sparrow.rollout_workers.vllm_backend.engine:VllmEngine", "sparrow.rollout_workers.vllm_backend.config:VllmEngineConfig")
