"""Every Prometheus metric Sparrow exports, on one registry per process (docs/metrics.md lists them).

Each process has a role (coordinator, rollout, trainer) and exports exactly the families its role
sets (`ROLE_FAMILIES`): a family of another role is not even registered, and a scalar gauge appears
only once it has been set, so no process exports a series it never sets (no NaN τ from a worker, no
schedule version stuck at 0). Reaching for another role's family raises AttributeError.

α per length bin is exported twice: `sparrow_alpha` is a real Prometheus histogram, cumulative since
the process started, so PromQL can take rates and `histogram_quantile` over any window; its buckets
are cut from the exact AlphaHistogram counts (no per-token observe calls). `sparrow_alpha_tail`
holds the percentiles of the latest step only, exactly as the controller sees them, which a bucketed
histogram cannot give at the resolution that matters near τ.
"""

import math
import resource
import sys
import threading
from collections.abc import Callable, Iterable, Mapping

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from sparrow.acceptance import AlphaHistogram
from sparrow.schedule import SparsitySchedule

from .config import MetricsConfig

REWARD_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
"""From 0: prometheus-client drops _sum of a histogram with a negative bucket; negative rewards count in le=0."""
LENGTH_BUCKETS = tuple(float(2**k) for k in range(6, 17))  # 64 … 65536 tokens
PUBLICATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0)
STALENESS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0)
RECOVERY_BUCKETS = (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

TRANSPORT_FAMILIES = ("sparrow_queue_depth", "sparrow_queue_capacity", "sparrow_transport_messages",
                      "sparrow_transport_full_queue_waits")
MEMORY_FAMILIES = ("sparrow_gpu_memory_bytes", "sparrow_host_memory_bytes")

ROLE_FAMILIES: dict[str, frozenset[str]] = {
    # `sparrow train` itself: α and the controller, the schedule, per-step results of the whole job
    # (from the step record), weight publication. It serves no queue (statistics reach it over Ray).
    "coordinator": frozenset({
        "sparrow_alpha", "sparrow_alpha_tail", "sparrow_alpha_tail_exact", "sparrow_alpha_target",
        "sparrow_schedule_budget_blocks", "sparrow_schedule_dense", "sparrow_schedule_version",
        "sparrow_controller_decisions", "sparrow_controller_violation_steps",
        "sparrow_speedup_measured", "sparrow_speedup_predicted",
        "sparrow_train_step", "sparrow_rollout_kv_read_fraction", "sparrow_rollout_utilisation",
        "sparrow_rollout_busy_batch_fraction", "sparrow_rollout_tail_share",
        "sparrow_rollout_carried_groups", "sparrow_rollout_resumed_samples", "sparrow_rollout_stale_tokens",
        "sparrow_rollout_budget_closes", "sparrow_weight_publication_seconds", "sparrow_staleness_steps",
        "sparrow_recoveries", "sparrow_recovery_seconds",
        "sparrow_eval_accuracy", "sparrow_eval_reward", "sparrow_eval_policy_version",
    }),
    # A rollout worker: what it generated and scored, the policy and schedule versions it decodes with.
    "rollout": frozenset({
        "sparrow_rollout_tokens", "sparrow_rollout_tokens_per_second", "sparrow_rollout_samples",
        "sparrow_reward", "sparrow_reward_errors", "sparrow_response_length_tokens",
        "sparrow_policy_version", "sparrow_schedule_version",
    }),
    # A DeepSpeed trainer rank: its step, memory, and (rank 0) the TrajectoryServer's `trajectory` queue.
    "trainer": frozenset({
        "sparrow_train_tokens_per_second", "sparrow_train_step_seconds", "sparrow_train_loss", "sparrow_train_grad_norm",
        "sparrow_train_skipped_updates", "sparrow_tis_capped_fraction",
        *MEMORY_FAMILIES, *TRANSPORT_FAMILIES,
    }),
}
"""Metric families (names as `registry.collect()` yields them: counters without `_total`) per role."""
ROLES = tuple(ROLE_FAMILIES)


class _AlphaCollector(Collector):
    """`sparrow_alpha{bin}`: cumulative α histogram per length bin, from merged AlphaHistograms."""

    def __init__(self, buckets: list[float]):
        self.buckets = buckets
        self.hist: AlphaHistogram | None = None
        self._lock = threading.Lock()

    def add(self, hist: AlphaHistogram) -> None:
        with self._lock:
            self.hist = hist.merge(self.hist) if self.hist is not None else AlphaHistogram(hist.counts.clone(), hist.sums.clone())

    def collect(self):
        family = HistogramMetricFamily(
            "sparrow_alpha", "Per-token acceptance rate α per length bin (cumulative since start)", labels=["bin"]
        )
        with self._lock:
            if self.hist is not None:
                counts, sums = self.hist.counts.numpy(), self.hist.sums.numpy()
                res = counts.shape[1]
                cum = np.cumsum(counts, axis=1)
                # Bucket le=x holds the cells [j/R, (j+1)/R) with (j+1)/R <= x (x rounded down to 1/R).
                edges = [min(int(math.floor(x * res + 1e-9)), res) for x in self.buckets]
                for b in np.flatnonzero(cum[:, -1]):
                    buckets = [(repr(x), float(cum[b, e - 1]) if e > 0 else 0.0) for x, e in zip(self.buckets, edges)]
                    family.add_metric([str(b)], buckets + [("+Inf", float(cum[b, -1]))], float(sums[b]))
        yield family


class _TransportCollector(Collector):
    """Queue depths and message counters of transport servers, read from their `stats()` at scrape time."""

    def __init__(self):
        self.sources: dict[str, Callable[[], dict[str, float]]] = {}

    def collect(self):
        depth = GaugeMetricFamily("sparrow_queue_depth", "Messages waiting in a server queue", labels=["queue"])
        capacity = GaugeMetricFamily("sparrow_queue_capacity", "Capacity of a server queue", labels=["queue"])
        messages = CounterMetricFamily(
            "sparrow_transport_messages", "Messages acknowledged by a server, by status", labels=["queue", "status"]
        )
        waits = CounterMetricFamily(
            "sparrow_transport_full_queue_waits", "Waits of a server handler on a full queue (backpressure)", labels=["queue"]
        )
        # Yielded with no sources too (no samples then): the family belongs to the role.
        for queue, stats in list(self.sources.items()):
            s = stats()
            depth.add_metric([queue], s["queue_depth"])
            capacity.add_metric([queue], s["queue_capacity"])
            for status in ("accepted", "duplicate", "invalid_argument", "unavailable"):
                messages.add_metric([queue, status], s[status])
            waits.add_metric([queue], s["waits"])
        yield from (depth, capacity, messages, waits)


class _Settable(Collector):
    """A gauge or counter whose samples appear only once set (a plain unlabelled prometheus_client
    Gauge reads 0 from the start). Counters hold a cumulative value read from elsewhere."""

    def __init__(self, name: str, documentation: str, labels: tuple[str, ...] = (), kind: str = "gauge"):
        self.name, self.documentation, self.labels, self.kind = name, documentation, list(labels), kind
        self.values: dict[tuple[str, ...], float] = {}

    def set(self, value: float, *label_values: str) -> None:
        if len(label_values) != len(self.labels):
            raise ValueError(f"{self.name}: labels {self.labels}, got values {label_values}")
        self.values[tuple(label_values)] = float(value)

    def get(self, *label_values: str) -> float | None:
        return self.values.get(tuple(label_values))

    def collect(self):
        cls = GaugeMetricFamily if self.kind == "gauge" else CounterMetricFamily
        family = cls(self.name, self.documentation, labels=self.labels)
        for labels, value in list(self.values.items()):
            family.add_metric(list(labels), value)
        yield family


def _host_memory() -> dict[str, float]:
    """rss and peak_rss of this process in bytes: /proc/self/status (VmHWM is computed at read time, so
    peak >= rss always), else getrusage's peak (KiB on Linux, bytes on macOS)."""
    try:
        with open("/proc/self/status") as f:
            fields = dict(line.split(":", 1) for line in f if line.startswith(("VmRSS:", "VmHWM:")))
        return {"rss": float(fields["VmRSS"].split()[0]) * 1024, "peak_rss": float(fields["VmHWM"].split()[0]) * 1024}
    except (OSError, KeyError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return {"peak_rss": float(peak)}


class _MemoryCollector(Collector):
    """Host memory of this process and GPU memory of its device, read at scrape time."""

    def __init__(self, worker: str, pool: str):
        self.worker, self.pool = worker, pool
        self.device = None  # a torch.device once the process has one

    def collect(self):
        labels = ["worker", "pool", "kind"]
        host = GaugeMetricFamily("sparrow_host_memory_bytes", "Host memory of this process: rss now, peak_rss", labels=labels)
        gpu = GaugeMetricFamily(
            "sparrow_gpu_memory_bytes", "GPU memory of this process's device (torch): allocated, reserved, peak_allocated",
            labels=labels,
        )
        for kind, value in _host_memory().items():
            host.add_metric([self.worker, self.pool, kind], value)
        torch = sys.modules.get("torch")
        device = self.device
        if torch is not None and device is not None and getattr(device, "type", None) == "cuda" and torch.cuda.is_initialized():
            for kind, read in (("allocated", torch.cuda.memory_allocated), ("reserved", torch.cuda.memory_reserved),
                               ("peak_allocated", torch.cuda.max_memory_allocated)):
                gpu.add_metric([self.worker, self.pool, kind], float(read(device)))
        yield from (host, gpu)


class SparrowMetrics:
    """The metric families of one process, plus helpers that update them from Sparrow's own objects.

    `role` (coordinator, rollout, trainer) picks the families (`ROLE_FAMILIES`); `worker` and `pool`
    label what this process is (e.g. worker="rollout-3", pool="rollout"). Build it with
    `for_coordinator`, `for_rollout` or `for_trainer`.
    """

    def __init__(self, config: MetricsConfig | None = None, worker: str = "", pool: str = "", *, role: str):
        if role not in ROLE_FAMILIES:
            raise ValueError(f"role={role!r}: one of {', '.join(ROLES)}")
        self.config = config or MetricsConfig()
        self.worker, self.pool, self.role = worker, pool, role
        self.families = ROLE_FAMILIES[role]
        self.registry = CollectorRegistry()
        r = self.registry
        want = self.families.__contains__
        if want("sparrow_alpha"):
            self._alpha = _AlphaCollector(self.config.alpha_buckets)
            r.register(self._alpha)
        if want("sparrow_queue_depth"):
            self._transport = _TransportCollector()
            r.register(self._transport)
        if want("sparrow_host_memory_bytes"):
            self._memory = _MemoryCollector(worker, pool)
            r.register(self._memory)
        for name, (attr, make) in _FAMILIES.items():
            if want(name):
                family = make()
                r.register(family)
                setattr(self, attr, family)

    @classmethod
    def for_coordinator(cls, config: MetricsConfig | None = None) -> "SparrowMetrics":
        return cls(config, worker="coordinator", pool="coordinator", role="coordinator")

    @classmethod
    def for_rollout(cls, config: MetricsConfig | None, index: int) -> "SparrowMetrics":
        return cls(config, worker=f"rollout-{index}", pool="rollout", role="rollout")

    @classmethod
    def for_trainer(cls, config: MetricsConfig | None, rank: int, device=None) -> "SparrowMetrics":
        """Trainer rank `rank`; `device` (a torch.device) adds its GPU memory when it is CUDA."""
        metrics = cls(config, worker=f"trainer-{rank}", pool="trainer", role="trainer")
        metrics._memory.device = device
        return metrics

    def __getattr__(self, name: str):
        # Only reached for attributes that do not exist: a family of another role, or a typo.
        owners = [role for role, families in ROLE_FAMILIES.items()
                  if any(_FAMILIES.get(f, ("",))[0] == name for f in families)]
        if owners:
            raise AttributeError(f"{name}: a {self.__dict__.get('role')} process does not export it "
                                 f"(only {' and '.join(owners)} processes do; ROLE_FAMILIES)")
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    def _has(self, family: str) -> bool:
        return family in self.families

    # α and the controller ------------------------------------------------------------------------
    def observe_alpha(self, hist: AlphaHistogram) -> None:
        """One step's merged α histogram: added to `sparrow_alpha`, percentiles to `sparrow_alpha_tail`."""
        self._alpha.add(hist)
        n = hist.count()
        for pct in self.config.alpha_quantiles:
            values = hist.percentile(pct)
            for b in n.nonzero().flatten().tolist():
                self.alpha_tail.labels(bin=str(b), quantile=f"{pct / 100:g}").set(float(values[b]))

    def set_schedule(self, schedule: SparsitySchedule, target: float | None = None) -> None:
        """The schedule this process put in force: its version (every role that has it), and on the
        coordinator the budget per bin and τ (`target`)."""
        if self._has("sparrow_schedule_budget_blocks"):
            for b in range(schedule.num_bins):
                blocks = schedule.blocks_for_bin(b)
                self.budget_blocks.labels(bin=str(b)).set(math.nan if blocks is None else blocks)
                self.dense.labels(bin=str(b)).set(1.0 if blocks is None else 0.0)
        self.schedule_version.labels(worker=self.worker, pool=self.pool).set(schedule.version)
        if target is not None:
            self.alpha_target.set(target)

    def record_control_step(self, step, target: float) -> None:
        """A `ControlStep` from the controller: decisions, violation counters and the schedule."""
        for d in step.decisions:
            self.decisions.labels(bin=str(d.bin), reason=d.reason).inc()
            self.violation_steps.labels(bin=str(d.bin)).set(d.stats.get("violations", 0))
        self.set_schedule(step.schedule, target)

    def set_predicted_speedup(self, cost_model, schedule: SparsitySchedule) -> float:
        """`sparrow.cost.CostModel` roofline speedup (dense seconds over sparse) of `schedule`."""
        speedup = cost_model.compare(schedule).speedup_seconds
        self.speedup_predicted.labels(pool="rollout").set(speedup)
        return speedup

    # the coordinator's step ----------------------------------------------------------------------
    def record_step(self, record, summary, target: float | None = None) -> None:
        """The coordinator's per-step series from a `StepRecord` and rank 0's `BatchSummary`.

        The dense probe's speedup is kept between probe steps; each fault with a `recovery_seconds`
        counts one recovery of its kind (a step record lists a fault once); `target` sets τ.
        """
        self.train_step.set(record.step + 1)
        self.kv_read_fraction.set(record.rollout.kv_read_fraction)
        if record.rollout.speedup_measured is not None:
            self.speedup_measured.labels(pool="rollout").set(record.rollout.speedup_measured)
        if record.predicted_speedup is not None:
            self.speedup_predicted.labels(pool="rollout").set(record.predicted_speedup)
        for worker, fraction in record.rollout.utilisation.items():
            self.utilisation.labels(worker=worker).set(fraction)
        if record.rollout.busy_batch_fraction is not None:
            self.busy_batch_fraction.set(record.rollout.busy_batch_fraction)
            self.tail_share.set(record.rollout.tail_share)
        self.carried_groups.inc(record.rollout.carried_out)
        self.resumed_samples.inc(record.rollout.resumed_samples)
        self.stale_tokens.inc(record.rollout.stale_tokens)
        self.budget_closes.inc(record.rollout.closed_by_budget)
        self.weight_publication.labels(pool="trainer").observe(record.publish.seconds)
        for fault in record.faults:
            if fault.recovery_seconds is not None:
                self.record_recovery(fault.kind, fault.recovery_seconds)
        for lag in summary.staleness:
            self.staleness.labels(pool="trainer").observe(lag)
        if target is not None:
            self.alpha_target.set(target)
        exact = record.alpha_exact
        if exact is not None:
            for b, (p, n) in enumerate(zip(exact.p5, exact.tokens)):
                if n and p is not None:
                    self.alpha_tail_exact.labels(bin=str(b), quantile=f"{exact.percentile / 100:g}").set(p)

    def record_eval(self, record) -> None:
        """A held-out evaluation (`EvalRecord`): accuracy and mean reward per mode, and the policy it scored."""
        for r in record.results:
            if r.accuracy is not None:
                self.eval_accuracy.labels(mode=r.mode).set(r.accuracy)
                self.eval_reward.labels(mode=r.mode).set(r.reward_mean)
        self.eval_policy_version.set(record.policy_version)

    def record_recovery(self, kind: str, seconds: float) -> None:
        """A finished recovery of `kind` (e.g. rollout_worker_lost, trainer_lost) that took `seconds`
        (record_step calls it for the faults of a step record)."""
        self.recoveries.labels(kind=kind).inc()
        self.recovery_seconds.labels(kind=kind).observe(seconds)

    # rollouts ------------------------------------------------------------------------------------
    def record_samples(self, trajectories: Iterable) -> None:
        """Finished `Trajectory`s: tokens, finish reasons, response lengths and rewards."""
        for t in trajectories:
            n = int(t.sample.token_ids.numel())
            self.tokens.labels(worker=self.worker, pool=self.pool).inc(n)
            self.samples.labels(worker=self.worker, pool=self.pool, finish_reason=t.sample.finish_reason).inc()
            if t.sample.finish_reason != "error":
                self.response_length.labels(pool=self.pool).observe(n)
            if t.reward is not None:
                self.reward.labels(pool=self.pool).observe(t.reward)

    def record_reward_error(self, reason: str) -> None:
        self.reward_errors.labels(worker=self.worker, pool=self.pool, reason=reason).inc()

    # trainer ranks -------------------------------------------------------------------------------
    def record_train_step(self, metrics: Mapping[str, float], skipped_updates: int | None = None) -> None:
        """A rank's `StepResult.metrics` (train/tokens_per_s, train/seconds, train/pg_loss,
        train/grad_norm, train/tis_capped_fraction: all-reduced, so every rank has the job's values;
        the seconds are this rank's) and DeepSpeed's cumulative `skipped_steps` (optimizer steps
        skipped on overflow; restored with a checkpoint)."""
        labels = {"worker": self.worker, "pool": self.pool}
        for key, family in (("train/tokens_per_s", self.train_tokens_per_second), ("train/seconds", self.train_step_seconds),
                            ("train/pg_loss", self.train_loss), ("train/grad_norm", self.train_grad_norm),
                            ("train/tis_capped_fraction", self.tis_capped_fraction)):
            if key in metrics:
                family.labels(**labels).set(float(metrics[key]))
        if skipped_updates is not None:
            self.skipped_updates.set(skipped_updates, self.worker, self.pool)

    # transport -----------------------------------------------------------------------------------
    def watch_transport(self, queue: str, stats: Callable[[], dict[str, float]]) -> None:
        """Export a transport server's queue depth and message counters (`server.stats`) as `queue`
        (trainer rank 0's TrajectoryServer: the only server with a queue)."""
        if not self._has("sparrow_queue_depth"):
            owners = " and ".join(role for role, families in ROLE_FAMILIES.items() if "sparrow_queue_depth" in families)
            raise AttributeError(f"watch_transport: a {self.role} process serves no queue (only {owners} processes do; ROLE_FAMILIES)")
        self._transport.sources[queue] = stats


def _gauge(name, doc, labels=()):
    return lambda: Gauge(name, doc, list(labels), registry=None)


def _counter(name, doc, labels=()):
    return lambda: Counter(name, doc, list(labels), registry=None)


def _histogram(name, doc, labels, buckets):
    return lambda: Histogram(name, doc, list(labels), buckets=buckets, registry=None)


_PROCESS = ("worker", "pool")
_FAMILIES: dict[str, tuple[str, Callable[[], object]]] = {
    # family name: (attribute, factory). Which process exports which: ROLE_FAMILIES.
    "sparrow_alpha_tail": ("alpha_tail", _gauge("sparrow_alpha_tail", "α percentile per length bin, latest step", ("bin", "quantile"))),
    "sparrow_alpha_tail_exact": ("alpha_tail_exact", _gauge(
        "sparrow_alpha_tail_exact", "Exact α percentile per length bin, latest step (trainer.exact_alpha)", ("bin", "quantile"))),
    "sparrow_alpha_target": ("alpha_target", lambda: _Settable("sparrow_alpha_target", "Target τ for the tail percentile of α")),
    "sparrow_schedule_budget_blocks": ("budget_blocks", _gauge(
        "sparrow_schedule_budget_blocks", "KV blocks attended per row in a length bin (NaN when dense)", ("bin",))),
    "sparrow_schedule_dense": ("dense", _gauge("sparrow_schedule_dense", "1 when a length bin decodes densely", ("bin",))),
    "sparrow_schedule_version": ("schedule_version", _gauge(
        "sparrow_schedule_version", "Version of the schedule this process has in force", _PROCESS)),
    "sparrow_controller_decisions": ("decisions", _counter(
        "sparrow_controller_decisions", "Controller decisions per length bin and reason", ("bin", "reason"))),
    "sparrow_controller_violation_steps": ("violation_steps", _gauge(
        "sparrow_controller_violation_steps", "Consecutive judged steps a bin has been below τ", ("bin",))),
    "sparrow_speedup_measured": ("speedup_measured", _gauge(
        "sparrow_speedup_measured", "Measured rollout throughput, sparse over dense (latest dense probe)", ("pool",))),
    "sparrow_speedup_predicted": ("speedup_predicted", _gauge(
        "sparrow_speedup_predicted", "Cost-model predicted rollout speedup of the schedule in force", ("pool",))),
    "sparrow_train_step": ("train_step", lambda: _Settable("sparrow_train_step", "Training steps completed")),
    "sparrow_rollout_kv_read_fraction": ("kv_read_fraction", lambda: _Settable(
        "sparrow_rollout_kv_read_fraction", "KV blocks read by sparse decode over what dense decode reads, last step")),
    "sparrow_rollout_utilisation": ("utilisation", _gauge(
        "sparrow_rollout_utilisation", "Fraction of the last step's wall time a rollout worker was generating", ("worker",))),
    "sparrow_rollout_busy_batch_fraction": ("busy_batch_fraction", lambda: _Settable(
        "sparrow_rollout_busy_batch_fraction", "Samples in flight over max_num_seqs, time-weighted over the last "
        "step's rollout (engines' busy time, pooled)")),
    "sparrow_rollout_tail_share": ("tail_share", lambda: _Settable(
        "sparrow_rollout_tail_share", "Share of the last step's rollout time with fewer than half the peak batch in "
        "flight (the long tail)")),
    "sparrow_rollout_carried_groups": ("carried_groups", _counter(
        "sparrow_rollout_carried_groups", "GRPO groups a closing step handed to the next (partial rollouts)", ())),
    "sparrow_rollout_resumed_samples": ("resumed_samples", _counter(
        "sparrow_rollout_resumed_samples", "Trained samples whose tokens span more than one policy version "
        "(interrupted at a weight change and resumed)", ())),
    "sparrow_rollout_stale_tokens": ("stale_tokens", _counter(
        "sparrow_rollout_stale_tokens", "Trained tokens sampled by an older policy than the one trained (partial "
        "rollouts: carried and resumed samples)", ())),
    "sparrow_rollout_budget_closes": ("budget_closes", _counter(
        "sparrow_rollout_budget_closes", "Steps closed by their time budget (partial rollouts' close_after_s) with "
        "fewer groups done than prompts_per_step", ())),
    "sparrow_recoveries": ("recoveries", _counter("sparrow_recoveries", "Recoveries from a lost process, by kind", ("kind",))),
    "sparrow_recovery_seconds": ("recovery_seconds", _histogram(
        "sparrow_recovery_seconds", "Seconds from a loss to the job running again, by kind", ("kind",), RECOVERY_BUCKETS)),
    "sparrow_eval_accuracy": ("eval_accuracy", _gauge(
        "sparrow_eval_accuracy", "Held-out accuracy of the latest evaluated policy, per decoding mode", ("mode",))),
    "sparrow_eval_reward": ("eval_reward", _gauge(
        "sparrow_eval_reward", "Held-out mean reward of the latest evaluated policy, per decoding mode", ("mode",))),
    "sparrow_eval_policy_version": ("eval_policy_version", lambda: _Settable(
        "sparrow_eval_policy_version", "Policy version of the latest held-out evaluation")),
    "sparrow_rollout_tokens": ("tokens", _counter("sparrow_rollout_tokens", "Tokens generated", _PROCESS)),
    "sparrow_rollout_tokens_per_second": ("tokens_per_second", _gauge(
        "sparrow_rollout_tokens_per_second",
        "Tokens the worker's engine generated per busy second, last second of work or burst before going idle", _PROCESS)),
    "sparrow_rollout_samples": ("samples", _counter(
        "sparrow_rollout_samples", "Finished samples by finish reason", (*_PROCESS, "finish_reason"))),
    "sparrow_reward": ("reward", _histogram("sparrow_reward", "Reward per sample", ("pool",), REWARD_BUCKETS)),
    "sparrow_reward_errors": ("reward_errors", _counter(
        "sparrow_reward_errors", "reward.function calls scored reward.on_error, by reason (exception, timeout, invalid)",
        (*_PROCESS, "reason"))),
    "sparrow_response_length_tokens": ("response_length", _histogram(
        "sparrow_response_length_tokens", "Generated tokens per sample", ("pool",), LENGTH_BUCKETS)),
    "sparrow_policy_version": ("policy_version", _gauge("sparrow_policy_version", "Policy version in use", _PROCESS)),
    "sparrow_tis_capped_fraction": ("tis_capped_fraction", _gauge(
        "sparrow_tis_capped_fraction", "Fraction of tokens whose TIS weight hit the cap, last step", _PROCESS)),
    "sparrow_weight_publication_seconds": ("weight_publication", _histogram(
        "sparrow_weight_publication_seconds", "Seconds to publish new weights to the rollout pool", ("pool",),
        PUBLICATION_BUCKETS)),
    "sparrow_staleness_steps": ("staleness", _histogram(
        "sparrow_staleness_steps", "Policy versions between a sample's generation and its training step", ("pool",),
        STALENESS_BUCKETS)),
    "sparrow_train_tokens_per_second": ("train_tokens_per_second", _gauge(
        "sparrow_train_tokens_per_second", "Tokens (prompt + response) trained per second, last step", _PROCESS)),
    "sparrow_train_step_seconds": ("train_step_seconds", _gauge(
        "sparrow_train_step_seconds", "Seconds of this rank's last policy update", _PROCESS)),
    "sparrow_train_loss": ("train_loss", _gauge("sparrow_train_loss", "Policy-gradient loss per token, last step", _PROCESS)),
    "sparrow_train_grad_norm": ("train_grad_norm", _gauge(
        "sparrow_train_grad_norm", "Global gradient norm before clipping, last step", _PROCESS)),
    "sparrow_train_skipped_updates": ("skipped_updates", lambda: _Settable(
        "sparrow_train_skipped_updates", "Optimizer steps DeepSpeed skipped (overflow), cumulative over the run",
        _PROCESS, kind="counter")),
}
