"""Every Prometheus metric Sparrow exports, on one registry per process (docs/metrics.md lists them).

α per length bin is exported twice: `sparrow_alpha` is a real Prometheus histogram, cumulative since
the process started, so PromQL can take rates and `histogram_quantile` over any window; its buckets
are cut from the exact AlphaHistogram counts (no per-token observe calls). `sparrow_alpha_tail`
holds the percentiles of the latest step only, exactly as the controller sees them, which a bucketed
histogram cannot give at the resolution that matters near τ.
"""

import math
import threading
from collections.abc import Callable, Iterable

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
        for queue, stats in list(self.sources.items()):
            s = stats()
            depth.add_metric([queue], s["queue_depth"])
            capacity.add_metric([queue], s["queue_capacity"])
            for status in ("accepted", "duplicate", "invalid_argument", "unavailable"):
                messages.add_metric([queue, status], s[status])
            waits.add_metric([queue], s["waits"])
        yield from (depth, capacity, messages, waits)


class SparrowMetrics:
    """The metric families, plus helpers that update them from Sparrow's own objects.

    `worker` and `pool` label what this process is (e.g. worker="rollout-3", pool="rollout").
    """

    def __init__(self, config: MetricsConfig | None = None, worker: str = "", pool: str = ""):
        self.config = config or MetricsConfig()
        self.worker, self.pool = worker, pool
        self.registry = CollectorRegistry()
        r = self.registry
        self._alpha = _AlphaCollector(self.config.alpha_buckets)
        self._transport = _TransportCollector()
        r.register(self._alpha)
        r.register(self._transport)
        self.alpha_tail = Gauge("sparrow_alpha_tail", "α percentile per length bin, latest step", ["bin", "quantile"], registry=r)
        self.alpha_target = Gauge("sparrow_alpha_target", "Target τ for the tail percentile of α", registry=r)
        self.budget_blocks = Gauge(
            "sparrow_schedule_budget_blocks", "KV blocks attended per row in a length bin (NaN when dense)", ["bin"], registry=r
        )
        self.dense = Gauge("sparrow_schedule_dense", "1 when a length bin decodes densely", ["bin"], registry=r)
        self.schedule_version = Gauge("sparrow_schedule_version", "Version of the schedule in force", registry=r)
        self.decisions = Counter(
            "sparrow_controller_decisions", "Controller decisions per length bin and reason", ["bin", "reason"], registry=r
        )
        self.violation_steps = Gauge(
            "sparrow_controller_violation_steps", "Consecutive judged steps a bin has been below τ", ["bin"], registry=r
        )
        self.tokens = Counter("sparrow_rollout_tokens", "Tokens generated", ["worker", "pool"], registry=r)
        self.tokens_per_second = Gauge(
            "sparrow_rollout_tokens_per_second", "Decode throughput reported by the engine", ["worker", "pool"], registry=r
        )
        self.samples = Counter(
            "sparrow_rollout_samples", "Finished samples by finish reason", ["worker", "pool", "finish_reason"], registry=r
        )
        self.speedup_measured = Gauge(
            "sparrow_speedup_measured", "Measured rollout throughput, sparse over dense", ["pool"], registry=r
        )
        self.speedup_predicted = Gauge(
            "sparrow_speedup_predicted", "Cost-model predicted rollout speedup of the schedule in force", ["pool"], registry=r
        )
        self.reward = Histogram("sparrow_reward", "Reward per sample", ["pool"], buckets=REWARD_BUCKETS, registry=r)
        self.reward_errors = Counter(
            "sparrow_reward_errors", "reward.function calls scored reward.on_error, by reason (exception, timeout, invalid)",
            ["worker", "pool", "reason"], registry=r,
        )
        self.response_length = Histogram(
            "sparrow_response_length_tokens", "Generated tokens per sample", ["pool"], buckets=LENGTH_BUCKETS, registry=r
        )
        self.policy_version = Gauge("sparrow_policy_version", "Policy version in use", ["worker", "pool"], registry=r)
        self.tis_capped_fraction = Gauge(
            "sparrow_tis_capped_fraction", "Fraction of tokens whose TIS weight hit the cap, last step", ["pool"], registry=r
        )
        self.weight_publication = Histogram(
            "sparrow_weight_publication_seconds", "Seconds to publish new weights to the rollout pool", ["pool"],
            buckets=PUBLICATION_BUCKETS, registry=r,
        )
        self.staleness = Histogram(
            "sparrow_staleness_steps", "Policy versions between a sample's generation and its training step", ["pool"],
            buckets=STALENESS_BUCKETS, registry=r,
        )
        self.alpha_target.set(math.nan)

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
        for b in range(schedule.num_bins):
            blocks = schedule.blocks_for_bin(b)
            self.budget_blocks.labels(bin=str(b)).set(math.nan if blocks is None else blocks)
            self.dense.labels(bin=str(b)).set(1.0 if blocks is None else 0.0)
        self.schedule_version.set(schedule.version)
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
        self.speedup_predicted.labels(pool=self.pool).set(speedup)
        return speedup

    # rollouts and training -------------------------------------------------------------------------
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

    def record_staleness(self, trainer_version: int, policy_versions: Iterable[int]) -> None:
        for v in policy_versions:
            self.staleness.labels(pool=self.pool).observe(trainer_version - v)

    def watch_transport(self, queue: str, stats: Callable[[], dict[str, float]]) -> None:
        """Export a transport server's queue depth and message counters (`server.stats`) as `queue`."""
        self._transport.sources[queue] = stats
