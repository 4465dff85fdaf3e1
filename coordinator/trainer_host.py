"""`TrainerHost`: a `TrainerRank` that is also the trainer pool's gRPC endpoint (rank 0).

Rank 0 serves the TrajectoryServer. A background thread moves every acknowledged sample from the
server's queue into `pending` (keyed by sample id), so samples of later steps (async mode) wait
there instead of blocking the senders. `collect(step, ids)` takes exactly the ids of the groups the
dispatcher saw completed for that step, computes GRPO advantages over the whole batch, shards it
across the ranks (balanced by tokens) and puts each shard in Ray's object store; every rank then
trains on its shard (`train_shard`) and returns the ids it trained on; rank 0 also returns the
step's metrics and α histograms (over Ray: the job's control plane is Ray, gRPC carries samples).

Why this gives "every sample sent is trained on exactly once": the server de-duplicates by id (a
resend is acked DUPLICATE, never queued twice); `pending` is a dict keyed by id; `collect` pops each
expected id exactly once, fails naming the ids that never arrived, and discards the samples of
abandoned lease attempts of that step or earlier (their ids carry the attempt, so they are never
expected); `TrajectoryBatch.shard` partitions the batch; each rank reports exactly its shard.
"""

import math
import os
import threading
import time
from dataclasses import dataclass

import ray
import torch

from sparrow.coordinator.metrics import MetricsConfig, SparrowMetrics, start_metrics_server
from sparrow.coordinator.transport import JobCredentials, TrajectoryServer, TransportConfig, advertised_host
from sparrow.rollout_workers.resume import tokens_by_version
from sparrow.trainer import TrainerRank, Trajectory, TrajectoryBatch
from sparrow.trainer.alpha import AlphaReport

from .step_record import BatchSummary


@dataclass
class ShardResult:
    """One rank's part of a step: the ids it trained on; rank 0 adds the step's metrics and α (and exact α when
    trainer.exact_alpha is on)."""

    rank: int
    trained_ids: list[str]
    metrics: dict[str, float] | None = None
    alpha: AlphaReport | None = None
    alpha_exact: AlphaReport | None = None


def to_trainer_trajectory(t) -> Trajectory:
    """A received transport `Trajectory` (sample + reward + ids) as the trainer's `Trajectory`."""
    s = t.sample
    if t.reward is None:
        raise ValueError(f"sample {t.sample_id}: no reward; rollout workers score every sample they send")
    has_top = s.top_ids.dim() == 2 and s.top_ids.shape[-1] > 0
    return Trajectory(
        prompt_ids=torch.as_tensor(list(s.prompt_token_ids), dtype=torch.long),
        response_ids=s.token_ids.long(),
        rollout_logprobs=s.logprobs.float(),
        reward=float(t.reward),
        group_id=t.group_id,
        top_ids=s.top_ids.long() if has_top else None,
        top_logprobs=s.top_logprobs.float() if has_top else None,
        policy_version=s.policy_version,
        schedule_version=s.schedule_version,
        sample_id=t.sample_id,
    )


def kv_blocks_dense(prompt_len: int, response_len: int, block_size: int) -> int:
    """KV blocks a dense decode reads over a response: token t's pass sees P + t tokens."""
    lengths = prompt_len + torch.arange(response_len)
    return int(((lengths + block_size - 1) // block_size).sum())


def summarise(items: list, policy_version: int, block_size: int, dropped: list[str]) -> BatchSummary:
    """What the coordinator logs about a step's samples (all of them, failed ones included)."""
    ok = [t for t in items if t.sample.finish_reason != "error"]
    attended = sum(int(t.sample.blocks_attended.sum()) for t in ok)
    dense = sum(kv_blocks_dense(len(t.sample.prompt_token_ids), int(t.sample.token_ids.numel()), block_size) for t in ok)
    return BatchSummary(
        samples=len(items), failed=len(items) - len(ok),
        errors=[t.sample.error for t in items if t.sample.finish_reason == "error"][:3],
        rewards=[float(t.reward) for t in ok], response_lengths=[int(t.sample.token_ids.numel()) for t in ok],
        prompt_lengths=[len(t.sample.prompt_token_ids) for t in ok],
        truncated=sum(t.sample.finish_reason == "length" for t in ok),
        staleness=[policy_version - t.sample.policy_version for t in ok],
        resumed=sum("policy_versions" in t.sample.metadata for t in ok),
        stale_tokens=sum(n for t in ok for v, n in tokens_by_version(t.sample).items() if v < policy_version),
        kv_read_fraction=attended / dense if dense else 1.0,
        schedule_versions=sorted({t.sample.schedule_version for t in ok}), dropped=len(dropped), dropped_ids=dropped,
    )


def sample_step(t) -> int:
    return int(t.sample.metadata.get("step", -1))


class TrainerHost(TrainerRank):
    def __init__(self, config: dict, rank: int, world_size: int, threads: int, credentials: JobCredentials):
        torch.set_num_threads(threads)
        super().__init__(config, rank, world_size)
        self.credentials = credentials
        self.server: TrajectoryServer | None = None
        self.pending: dict[str, object] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._ingest_error: str | None = None
        self.metrics: SparrowMetrics | None = None
        self.metrics_server = None

    def node(self) -> dict:
        return {"rank": self.rank, "node_id": ray.get_runtime_context().get_node_id(), "pid": os.getpid()}

    def start_metrics(self, config: dict) -> str | None:
        """Serve this rank's /metrics (trainer role, worker="trainer-<rank>"; from metrics.port + 1 up);
        returns its URL for the scrape targets, None when metrics are off. Call after `setup`."""
        self.metrics = SparrowMetrics.for_trainer(MetricsConfig.model_validate(config), self.rank, self.device)
        if self.server is not None:
            self.metrics.watch_transport("trajectory", self.server.stats)
        self.metrics_server = start_metrics_server(self.metrics) if self.metrics.config.enabled else None
        return self.metrics_server.url if self.metrics_server else None

    # ------------------------------------------------------------------ ingest (rank 0)

    def start_ingest(self, transport: dict) -> str:
        """Serve trajectories; returns the address rollout workers send to."""
        config = TransportConfig.model_validate(transport)
        self.server = TrajectoryServer(config, self.credentials, server_id=f"trainer-{self.rank}")
        port = self.server.start()
        if self.metrics is not None:
            self.metrics.watch_transport("trajectory", self.server.stats)
        threading.Thread(target=self._drain_queue, name="ingest", daemon=True).start()
        return f"{advertised_host(config.host)}:{port}"

    def _drain_queue(self) -> None:
        while not self._stop.is_set():
            for t in self.server.get_batch(256, timeout=0.2):
                with self._cond:
                    if t.sample_id in self.pending:  # the server's dedupe makes this impossible
                        self._ingest_error = f"sample {t.sample_id} was queued twice by the trajectory server"
                    self.pending[t.sample_id] = t
                    self._cond.notify_all()

    def resume_ingest(self) -> None:
        """Reopen the trajectory server after a Drain RPC."""
        self.server.resume()

    def collect(self, step: int, expected: list[str], policy_version: int, max_staleness: int, timeout_s: float,
                carried: list[str] = ()) -> dict:
        """Take exactly the `expected` samples; shards (object refs, one per rank) and a `BatchSummary`. Samples of
        earlier steps not expected are strays (abandoned attempts) and dropped, except those of the `carried` request
        ids (partial rollouts: groups a later step trains)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            if self._ingest_error:
                raise RuntimeError(self._ingest_error)
            while missing := [i for i in expected if i not in self.pending]:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"step {step}: {len(missing)} of {len(expected)} samples never reached the trainer after "
                        f"{timeout_s:g} s (e.g. {missing[:3]}); raise run.collect_timeout_s or check the rollout workers"
                    )
                self._cond.wait(min(left, 1.0))
            items = [self.pending.pop(i) for i in expected]
            keep = set(carried)
            strays = [i for i, t in self.pending.items() if sample_step(t) <= step and i.rsplit("#", 1)[0] not in keep]
            for i in strays:
                del self.pending[i]
        stale = [t.sample_id for t in items if policy_version - t.sample.policy_version > max_staleness]
        if stale:  # admission control in the dispatcher makes this an invariant violation
            raise RuntimeError(f"step {step}: samples {stale[:3]} are more than {max_staleness} policy versions old")
        summary = summarise(items, policy_version, self.bins.block_size, strays)
        ok = [to_trainer_trajectory(t) for t in items if t.sample.finish_reason != "error"]
        if not ok:
            raise RuntimeError(f"step {step}: all {len(items)} samples failed (e.g. {summary.errors[:1]})")
        loss = self.config.loss
        batch = TrajectoryBatch(ok).with_grpo_advantages(loss.advantage_std_norm, loss.advantage_eps)
        shards = [ray.put(shard) for _, shard in batch.shard(self.world_size)]
        return {"shards": shards, "summary": summary}

    # ------------------------------------------------------------------ training (all ranks)

    def train_shard(self, shard: TrajectoryBatch, step: int) -> ShardResult:
        """One GRPO update on this rank's shard (collective)."""
        result = self.train_step(shard)
        if self.metrics is not None:
            self.metrics.record_train_step(result.metrics, self.engine.skipped_steps)
        ids = [t.sample_id for t in shard]
        if self.rank != 0:
            return ShardResult(self.rank, ids)
        metrics = {k: float(v) for k, v in result.metrics.items() if math.isfinite(float(v))}
        return ShardResult(self.rank, ids, metrics, result.alpha, result.alpha_exact)

    def stop_ingest(self) -> None:
        self._stop.set()
        if self.server is not None:
            self.server.stop(grace=0)
        if self.metrics_server is not None:
            self.metrics_server.close()
