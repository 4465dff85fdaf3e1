"""The logger interface (the shape of torchtune's metric loggers: `log_step`, `close`) and the fan-out
the driver holds."""

import importlib
from types import ModuleType
from typing import Protocol

from sparrow.coordinator.config import ConfigError
from sparrow.coordinator.step_record import StepRecord


class MetricLogger(Protocol):
    def log_step(self, record: StepRecord) -> None:
        """Record one finished training step."""

    def close(self) -> None:
        """Flush and release; nothing is logged after it."""


class Loggers:
    """Every logger of `run.loggers`: one `log_step` / `close` for the driver."""

    def __init__(self, loggers: list[MetricLogger]):
        self.loggers = loggers

    def log_step(self, record: StepRecord) -> None:
        for logger in self.loggers:
            logger.log_step(record)

    def close(self) -> None:
        """Close every logger even if one fails (then raise its error); a second call does nothing."""
        loggers, self.loggers = self.loggers, []
        errors = []
        for logger in loggers:
            try:
                logger.close()
            except Exception as exc:  # the others still flush
                errors.append(exc)
        if errors:
            raise errors[0]


def import_backend(module: str, logger: str) -> ModuleType:
    """Import a tracking package when its logger is opened: they are an optional extra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(
            f"run.loggers has {logger!r} but {module} cannot be imported ({exc}); install Sparrow's tracking extra "
            "(bash deploy/setup.sh --tracking, or --gpu --tracking; on a bare install pip install 'sparrow-rl[tracking]') "
            f"or remove {logger!r} from run.loggers"
        ) from None
