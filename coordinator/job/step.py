"""`StepLoop`: one training step of the job, from queued prompts to its record.

It queues steps' GRPO groups in the dispatcher ahead of time (admission happens at lease time), waits for
step k's groups while supervising the job, has rank 0 collect exactly their acknowledged samples, trains on
them, publishes policy version k+1, lets the controller read the step's α, and writes the step's record
to every sink. The job's step and policy version live on the `TrainingJob`; this advances them.
"""

import dataclasses
import time
from typing import TYPE_CHECKING

import ray

from sparrow.coordinator.metrics import BatchShape, EngineTime, batch_shape, busy_fractions

from ..progress import fmt
from ..step_record import ControllerSummary, StepRecord, StepTiming, alpha_tail, rollout_stats, schedule_snapshot
from ..trainer_host import ShardResult
from ..work_queue import EvalTask
from .ledger import LedgerLine
from .trainers import POLL_S

if TYPE_CHECKING:
    from ..driver import TrainingJob


class StepLoop:
    def __init__(self, job: "TrainingJob"):
        self.job = job
        self.inflight: set[int] = set()
        """Steps whose groups are queued and not yet trained."""
        self.tokens_seen = 0
        self.evaluations: list = []
        """Held-out evaluations since the last step record (it carries them)."""
        self.events_logged = 0
        self.engine_mark: tuple[float, dict[str, EngineTime]] = (time.perf_counter(), {})
        """When the previous step's rollouts were in, and each worker's `EngineTime` then."""
        self.spares_due = True
        """Partial rollouts: the next step queued brings the spare groups (after a start or a rollback)."""

    def dispatch_until(self, last: int) -> None:
        """Queue the groups of every step up to `last` not yet queued (admission happens at lease time)."""
        job = self.job
        first = max([job.step - 1, *self.inflight]) + 1
        every, n = job.config.rollout.speedup_probe_every, job.config.rollout.sampling.n
        probe_groups = max(1, job.config.rollout.engine_config().max_num_seqs // n)
        run = job.config.run
        for j in range(first, last + 1):
            records = job.data.batch(j, run.prompts_per_step)
            probe = records[:probe_groups] if every and j % every == 0 else []
            if run.partial_rollout.enabled and self.spares_due:
                records += job.data.spares(j, run.partial_rollout.extra_groups)
                self.spares_due = False
            ray.get(job.dispatcher.add_step.remote(j, records, probe, run.prompts_per_step))
            self.inflight.add(j)

    def forget_from(self, step: int) -> None:
        """The job went back to `step` (a trainer recovery): steps from there on are queued again (with the spares:
        the groups carried into them are gone with them)."""
        self.inflight = {j for j in self.inflight if j < step}
        self.spares_due = True

    def _engine_window(self, now: float) -> tuple[dict[str, float], BatchShape]:
        """Since the previous step's rollouts were in: per worker, engine-busy seconds over wall seconds, and the
        batch over the busy time, from the workers' latest `EngineTime` reports to the dispatcher."""
        reports = ray.get(self.job.dispatcher.engine_time.remote())
        since, before = self.engine_mark
        self.engine_mark = (now, {**before, **reports})
        utilisation = busy_fractions({w: r.busy_seconds for w, r in before.items()},
                                     {w: r.busy_seconds for w, r in reports.items()}, now - since)
        shape = batch_shape({w: list(r.occupancy) for w, r in before.items()},
                            {w: list(r.occupancy) for w, r in reports.items()},
                            self.job.config.rollout.engine_config().max_num_seqs)
        return utilisation, shape

    def _await_rollouts(self, step: int):
        """Wait for step `step`'s groups (or, with a time budget, for as long as it allows), supervising the fleet
        and moving the token bar meanwhile."""
        job = self.job
        budget, t0 = job.config.run.partial_rollout.close_after_s, time.perf_counter()
        while True:
            over = budget is not None and time.perf_counter() - t0 >= budget
            done, total, complete = ray.get(job.dispatcher.progress.remote(step, over))
            if complete:
                return ray.get(job.dispatcher.take_step.remote(step, over))
            job.fleet.step = step
            self._tick()
            if job.show_progress:
                tokens = sum(p["tokens"] for p in job.fleet.progress())
                job.progress.add_tokens(tokens - self.tokens_seen)
                self.tokens_seen = max(self.tokens_seen, tokens)
            time.sleep(POLL_S)

    def _tick(self) -> None:
        """Supervise while waiting for the rollout side. No trainer call is in flight here, so a worker that joined
        without the current version (in-place or broadcast channels) is handed it now: until it holds it, it can
        lease neither the step's groups nor the evaluation of that version."""
        self.job.supervise()
        self.job.publication.for_joiners(self.job.version)

    def train(self) -> StepRecord:
        """Step `job.step`: rollouts, collect, train, publish, evaluate, control; its record."""
        job = self.job
        cfg, k = job.config, job.step
        t0 = time.perf_counter()
        work = self._await_rollouts(k)
        self.inflight.discard(k)
        t_rollout = time.perf_counter()
        utilisation, batch = self._engine_window(t_rollout)
        to_train = job.time_sharing.to_training()
        t_turned = time.perf_counter()
        if job.publication.loads:
            job.publication.settle_loads()
        groups = [report for _, report in work.done.values()]
        expected = [i for g in groups for i in g.sample_ids]
        for g in groups:
            for sid, field, message in g.rejected:
                job.log(f"step {k + 1}: {g.worker} sample {sid} rejected by the trainer ({field}: {message})")
        collected = job.trainers.call([job.trainers.rank0.collect.remote(
            k, expected, job.version, cfg.run.trained_staleness, cfg.run.collect_timeout_s, work.carried_requests)])[0]
        t_collect = time.perf_counter()
        shards = collected["shards"]
        results: list[ShardResult] = job.trainers.call([a.train_shard.remote(s, k) for a, s in zip(job.trainers.actors, shards)])
        del shards, collected["shards"]
        t_train = time.perf_counter()
        summary = collected["summary"]
        job.ledger.record(LedgerLine(k, job.version, summary.schedule_versions, [r.trained_ids for r in results],
                                     list(work.abandoned), summary.dropped_ids))
        job.version += 1
        publish = job.publication.publish(job.version, wait=cfg.run.synchronous)
        t_published = time.perf_counter()
        to_rollout = job.time_sharing.to_rollout()
        t_publish = time.perf_counter()
        if job.eval_set and (job.version % cfg.data.eval.every == 0 or k + 1 == cfg.run.steps):
            self.evaluate()
        t_eval = time.perf_counter()
        before = job.schedule
        alpha, upper, decision = job.sparsity.control(k, results[0])
        t_control = time.perf_counter()
        job.step += 1
        percentile = job.sparsity.controller_config.percentile
        record = StepRecord(
            step=k, policy_version=job.version - 1,
            rollout=rollout_stats(groups, collected["summary"], cfg.reward.correct, _rollout_seconds(work),
                                  work.probe_result.speedup if work.probe_result else None, work.requeued,
                                  utilisation, work.speculated, batch, work.carried_in,
                                  work.carried_out, work.closed_by_budget),
            train=results[0].metrics,
            alpha=alpha_tail(alpha, upper, percentile),
            schedule=schedule_snapshot(job.schedule, before),
            controller=ControllerSummary(job.sparsity.controller is not None, 0 if decision is None else
                                         sum(d["old"] != d["new"] for d in decision["decisions"])),
            predicted_speedup=job.sparsity.predicted_speedup(collected["summary"], job.cost_shape, job.cost_hardware),
            publish=publish,
            timing=StepTiming(rollout_wait=t_rollout - t0, collect=t_collect - t_turned, train=t_train - t_collect,
                              publish=t_published - t_train, evaluate=t_eval - t_publish, control=t_control - t_eval,
                              step=time.perf_counter() - t0, elapsed=time.perf_counter() - job.started,
                              to_train=t_turned - t_rollout, to_rollout=t_publish - t_published,
                              transitions={**to_train, **to_rollout}),
            faults=job.fleet.resolved[self.events_logged:],
            evaluations=self.evaluations,
            alpha_exact=None if results[0].alpha_exact is None else
            alpha_tail(results[0].alpha_exact.combined()[0], None, percentile),
        )
        self._write(record, collected["summary"], decision)
        return record

    def _write(self, record: StepRecord, summary, decision: dict | None) -> None:
        """The record to every sink: events and decisions files, Prometheus, the loggers, the user's notices."""
        job = self.job
        self.evaluations = []
        self.events_logged = len(job.fleet.resolved)
        for event in record.faults:
            job.run_dir.append(job.run_dir.events_file, dataclasses.asdict(event))
        job.metrics.record_step(record, summary, job.sparsity.controller_config.target)
        job.loggers.log_step(record)
        if decision is not None:
            job.run_dir.append(job.run_dir.decisions_file, decision)
        job.notices.after_step(record)

    def evaluate(self) -> None:
        """Score the held-out set with the current policy (dense and/or sparse) on one idle worker."""
        job = self.job
        cfg = job.config.data.eval
        task = EvalTask(job.version, tuple(job.eval_set), tuple(cfg.modes), cfg.samples, cfg.decoding == "greedy")
        ray.get(job.dispatcher.add_eval.remote(task))
        while (record := ray.get(job.dispatcher.take_eval.remote(job.version))) is None:
            self._tick()
            time.sleep(POLL_S)
        job.metrics.record_eval(record)
        self.evaluations.append(record)
        scores = ", ".join(f"{r.mode} {fmt(r.accuracy, '.3f')}" for r in record.results)
        job.log(f"eval of policy {record.policy_version} on {record.prompts} held-out prompts ({record.decoding}): "
                f"accuracy {scores}")


def _rollout_seconds(work) -> float:
    if work.first_lease is None or work.last_done is None:
        return 0.0
    return work.last_done - work.first_lease
