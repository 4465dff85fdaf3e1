"""Rollout backends by name: what `rollout.engine` selects, and the only list of them.

Each backend is registered as dotted paths to its engine and config classes and imported only when
looked up, so importing this module (or the job config) imports neither engine, and vLLM only when the
"vllm" backend is built. The job config takes its backend names and their sections (`rollout.<name>`)
from here, so a new backend is its package plus one `register` call (docs/architecture.md). A package
outside this repository makes that call from a function it names under the `sparrow.rollout_backends`
entry-point group, which every process (the driver and each Ray worker) loads at its first lookup.
"""

from dataclasses import dataclass
from importlib import import_module
from importlib.metadata import entry_points

from .api import RolloutEngine
from .engine_settings import EngineSettings


@dataclass(frozen=True)
class Backend:
    engine: str
    """`module:Class` of the `RolloutEngine`."""
    config: str
    """`module:Class` of its `EngineSettings` section."""


_BACKENDS: dict[str, Backend] = {}

DEFAULT = "native"
"""The backend a job runs when `rollout.engine` is not set: the embedded engine, which needs no extra package."""


ENTRY_POINT_GROUP = "sparrow.rollout_backends"
_plugins_loaded = False


def register(name: str, engine: str, config: str) -> None:
    _BACKENDS[name] = Backend(engine, config)


def _load_plugins() -> None:
    """Call every installed package's registration function (once per process)."""
    global _plugins_loaded
    if not _plugins_loaded:
        _plugins_loaded = True
        for point in entry_points(group=ENTRY_POINT_GROUP):
            point.load()()


def names() -> list[str]:
    _load_plugins()
    return sorted(_BACKENDS)


def _backend(name: str) -> Backend:
    _load_plugins()
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
