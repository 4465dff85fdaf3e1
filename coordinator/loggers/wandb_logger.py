"""`wandb`: one W&B `log` of the record's scalars per step, the job's config as the run's config.

Offline by default (`run.wandb.mode`): the run is written to RUN_DIR/wandb/offline-run-*/ and
nothing leaves the machine; `wandb sync` uploads it later.
"""

from sparrow.coordinator.config import ConfigError, SparrowConfig
from sparrow.coordinator.run_dir import RunDir
from sparrow.coordinator.step_record import StepRecord

from .base import import_backend
from .scalars import step_scalars

OFFLINE_HINT = ("or keep run.wandb.mode='offline' (the default) and upload RUN_DIR/wandb/offline-run-* later with "
                "`wandb sync`")


class WandbLogger:
    def __init__(self, config: SparrowConfig, run_dir: RunDir):
        wandb = import_backend("wandb", "wandb")
        cfg = config.run.wandb
        if cfg.mode == "online" and not wandb.login(verify=False, prompt=False):  # never a prompt mid-job
            raise ConfigError(
                "run.wandb.mode='online' needs a W&B API key and none is configured (WANDB_API_KEY, a wandb settings "
                f"file or ~/.netrc); run `wandb login` or set WANDB_API_KEY, {OFFLINE_HINT}"
            )
        try:
            self.run = wandb.init(
                dir=run_dir.path, mode=cfg.mode, project=cfg.project, entity=cfg.entity,
                name=cfg.name or run_dir.path.name, group=cfg.group, tags=cfg.tags,
                config=config.model_dump(mode="json"), settings=wandb.Settings(init_timeout=cfg.init_timeout_s),
            )
        except wandb.errors.Error as exc:
            if cfg.mode == "offline":
                raise
            first = str(exc).splitlines()[0]
            raise ConfigError(
                f"run.wandb.mode='online': W&B could not start the run within init_timeout_s={cfg.init_timeout_s} "
                f"({first}); check the network and WANDB_BASE_URL / the API key, {OFFLINE_HINT}"
            ) from None

    def log_step(self, record: StepRecord) -> None:
        self.run.log(step_scalars(record), step=record.step)

    def close(self) -> None:
        self.run.finish()
