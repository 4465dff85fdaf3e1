"""`RolloutWorker`: one rollout engine (native or vLLM) as a Ray actor.

Per step it tokenizes its share of the prompts, generates the GRPO groups, scores every finished
sample (it holds the reference answers) and streams the samples with their rewards to the trainer
pool's TrajectoryServer over gRPC as they finish. It serves ControlService itself (schedule updates,
drain, health) and its own Prometheus /metrics. Weights arrive between generate calls (Ray calls to
one actor run in submission order), and so does a new schedule: one staged by UpdateSchedule is put
in force at the start of the next generate call, so every sample has exactly one schedule version.

A plain class: `pools.py` wraps it with `ray.remote`; tests may use it directly.
"""

import asyncio
import os
import queue
import threading
import time

import ray
import torch

from sparrow.coordinator.metrics import SparrowMetrics, start_metrics_server
from sparrow.coordinator.transport import ControlServer, Health, JobCredentials, ScheduleState, Trajectory, TrajectoryClient, advertised_host
from sparrow.rollout_workers.api import RolloutEngine, RolloutRequest, SamplingParams
from sparrow.rollout_workers.registry import create_engine
from sparrow.schedule import SparsitySchedule
from sparrow.seeds import stable_seed
from sparrow.weight_sync import CollectiveGroup, CollectiveSource, HandleSource, WeightReceiver

from .config import SparrowConfig
from .data import PromptRecord, render_prompt
from .rewards import RewardFunction, reward_metadata

_DONE = object()


def engine_model_dir(config: SparrowConfig, model: str) -> str:
    return config.rollout.engine_config().model or model


def build_engine(config: SparrowConfig, model: str, index: int) -> RolloutEngine:
    """The configured engine (a registry lookup) on `model` (unless its section names another), seeded per worker."""
    update = {"model": engine_model_dir(config, model), "seed": stable_seed(config.run.seed, index, 2) % (2**31)}
    return create_engine(config.rollout.engine, config.rollout.engine_config().model_copy(update=update))


class RolloutWorker:
    def __init__(self, config: dict, model: str, index: int, threads: int, credentials: JobCredentials):
        torch.set_num_threads(threads)
        self.credentials = credentials
        self.config = SparrowConfig.model_validate(config)
        self.index, self.worker_id = index, f"rollout-{index}"
        self.engine = build_engine(self.config, model, index)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(engine_model_dir(self.config, model))
        self.client: TrajectoryClient | None = None
        self.schedule_state = ScheduleState(self._stage_schedule)
        self._staged: SparsitySchedule | None = None
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._draining = False
        self._tokens = 0
        self._samples = 0
        self._probe_tokens = 0
        self._probing: int | None = None
        self.metrics = SparrowMetrics.for_rollout(self.config.metrics, index)  # [monitoring] the rollout role's families
        self.metrics_server = start_metrics_server(self.metrics) if self.config.metrics.enabled else None  # port + 1 up
        self.reward = RewardFunction(self.config.reward, self.config.data.source, on_error=self.metrics.record_reward_error)
        self._control = self._start_control()
        self.weight_group = None

    # ------------------------------------------------------------------ set-up

    def _start_control(self) -> ControlServer:
        server = ControlServer(self.config.transport.model_copy(update={"port": 0}), self.credentials, self)
        self.control_port = server.start()
        return server

    def info(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            "worker_id": self.worker_id,
            "node_id": ctx.get_node_id(),
            "pid": os.getpid(),
            "control_address": f"{advertised_host(self.config.transport.host)}:{self.control_port}",
            "metrics_url": self.metrics_server.url if self.metrics_server else None,
            "engine": type(self.engine).__name__,
        }

    def connect(self, trajectory_address: str) -> None:
        if self.client is not None:
            self.client.close()
        self.client = TrajectoryClient(trajectory_address, self.config.transport, self.credentials, client_id=self.worker_id)

    # ------------------------------------------------------------------ ControlService

    def _stage_schedule(self, schedule: SparsitySchedule) -> None:
        self.engine.check_schedule(schedule)
        with self._lock:
            self._staged = schedule

    def update_schedule(self, schedule: SparsitySchedule) -> tuple[bool, int]:
        return self.schedule_state.update(schedule)

    def drain(self, timeout_s: float) -> tuple[bool, int]:
        """Refuse new generate calls and wait up to `timeout_s` for the one running."""
        self._draining = True
        return self._idle.wait(timeout_s), 0 if self._idle.is_set() else 1

    def health(self) -> Health:
        status = "draining" if self._draining else "serving"
        version = self.engine.schedule.version if self.engine.schedule is not None else 0
        gauges = {"tokens": float(self._tokens), "samples": float(self._samples), "busy": float(not self._idle.is_set())}
        return Health(status, self.worker_id, version, self.engine.policy_version, gauges)

    def resume(self) -> None:
        self._draining = False

    # ------------------------------------------------------------------ rollouts

    def _requests(self, step: int, records: list[PromptRecord]) -> list[RolloutRequest]:
        s = self.config.rollout.sampling
        out = []
        for r in records:
            ids = render_prompt(self.tokenizer, r.messages, self.config.data.chat_template)
            sampling = SamplingParams(
                max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                seed=stable_seed(self.config.run.seed, step, r.index, 3), n=s.n, logprobs=s.logprobs,
            )
            meta = {"step": str(step), "answer": r.answer, "index": str(r.index)}
            out.append(RolloutRequest(r.prompt_id, tuple(ids), sampling, metadata=meta))
        return out

    def _produce(self, requests: list[RolloutRequest], out: queue.Queue, timing: dict) -> None:
        async def run():
            async for sample in self.engine.stream(requests):
                out.put(sample)

        start = time.perf_counter()
        try:
            asyncio.run(run())
        except BaseException as exc:  # handed to the caller's thread and re-raised there
            out.put(exc)
        finally:
            timing["engine_seconds"] = time.perf_counter() - start
            out.put(_DONE)

    def generate(self, step: int, records: list[PromptRecord], probe: bool = False) -> dict:
        """Generate, score and send the groups of `records`; returns what was sent and acknowledged.

        `probe`: afterwards decode the same requests densely (nothing is sent) and report the measured
        speedup, sparse tokens/s over dense tokens/s of the engine.
        """
        if self._draining:
            return {"worker": self.worker_id, "step": step, "drained": True}
        if self.client is None:
            raise RuntimeError(f"{self.worker_id}: connect() to the trajectory server before generate()")
        self._idle.clear()
        try:
            with self._lock:
                staged, self._staged = self._staged, None
            if staged is not None:
                self.engine.set_schedule(staged)
                self.metrics.set_schedule(staged)  # [monitoring] sparrow_schedule_version of this worker
            report = self._generate(step, records)
            if probe and self.engine.schedule is not None:
                dense = self._dense_tokens_per_s(self._requests(step, records))
                report["speedup_measured"] = report["engine_tokens_per_s"] / dense  # the coordinator exports it
            return report
        finally:
            self._idle.set()

    def _dense_tokens_per_s(self, requests: list[RolloutRequest]) -> float:
        schedule = self.engine.schedule
        self._probing = self.progress()["tokens"]
        before = self.engine.counters().tokens_generated
        self.engine.set_schedule(None)
        try:
            start = time.perf_counter()
            tokens = sum(int(s.token_ids.numel()) for s in self.engine.generate(requests))
            seconds = time.perf_counter() - start
        finally:
            self.engine.set_schedule(schedule)
            self._probe_tokens += self.engine.counters().tokens_generated - before
            self._probing = None
        return tokens / seconds

    def _generate(self, step: int, records: list[PromptRecord]) -> dict:
        start = time.perf_counter()
        requests = self._requests(step, records)
        by_id = {r.prompt_id: r for r in records}
        out: queue.Queue = queue.Queue()
        timing: dict = {}
        thread = threading.Thread(target=self._produce, args=(requests, out, timing), name="engine", daemon=True)
        thread.start()
        errors: list[BaseException] = []
        tally = {"samples": 0, "failed": 0, "tokens": 0}

        def trajectories():
            while (item := out.get()) is not _DONE:
                if isinstance(item, BaseException):
                    errors.append(item)
                    continue
                reward = None
                if item.finish_reason != "error":
                    text = self.tokenizer.decode(item.token_ids.tolist(), skip_special_tokens=True)
                    record = by_id[item.request_id]
                    meta = reward_metadata(record, step, item.sample_index, item.finish_reason)
                    reward = self.reward(text, record.answer, item.finish_reason, meta)
                else:
                    tally["failed"] += 1
                n = int(item.token_ids.numel())
                tally["samples"] += 1
                tally["tokens"] += n
                self._tokens += n
                self._samples += 1
                t = Trajectory.of(item, reward=reward, worker_id=self.worker_id)
                self.metrics.record_samples([t])
                yield t

        report = self.client.send(trajectories())
        thread.join()
        if errors:
            raise errors[0]
        seconds = time.perf_counter() - start
        self.metrics.tokens_per_second.labels(worker=self.worker_id, pool="rollout").set(tally["tokens"] / seconds)
        self.metrics.policy_version.labels(worker=self.worker_id, pool="rollout").set(self.engine.policy_version)
        return {
            "worker": self.worker_id, "step": step, "drained": False, "requests": len(requests),
            "samples": tally["samples"], "failed": tally["failed"], "tokens": tally["tokens"], "seconds": seconds,
            "accepted": report.accepted, "duplicate": report.duplicate,
            "rejected": [(r.id, r.field, r.message) for r in report.rejected], "streams": report.streams,
            "policy_version": self.engine.policy_version,
            "schedule_version": self.engine.schedule.version if self.engine.schedule is not None else -1,
            "engine_tokens_per_s": tally["tokens"] / timing["engine_seconds"],
        }

    @ray.method(concurrency_group="monitor")
    def progress(self) -> dict:
        """Rollout tokens and samples so far, dense probes excluded (served while generate runs: Ray
        concurrency group 'monitor')."""
        if self._probing is not None:
            return {"tokens": self._probing, "samples": self._samples}
        try:
            engine_tokens = self.engine.counters().tokens_generated - self._probe_tokens
        except Exception:  # a stats read racing a step must never break progress reporting
            engine_tokens = self._tokens
        return {"tokens": max(engine_tokens, self._tokens), "samples": self._samples}

    # ------------------------------------------------------------------ weights

    def load_weights(self, handle) -> dict:
        """A version published to Ray's object store (`WeightHandle`)."""
        report = WeightReceiver(self.engine).receive(HandleSource(handle))
        self.metrics.policy_version.labels(worker=self.worker_id, pool="rollout").set(report.version)
        return {"version": report.version, "bytes": report.nbytes, "seconds": report.seconds}

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
        device = "cuda" if backend == "nccl" else "cpu"
        self.weight_group = CollectiveGroup(host, port, rank, world_size, backend=backend, device=device, timeout_s=timeout_s)

    def receive_weights(self) -> dict:
        """The next version broadcast over the weight group (the trainer sends concurrently)."""
        report = WeightReceiver(self.engine).receive(CollectiveSource(self.weight_group))
        self.metrics.policy_version.labels(worker=self.worker_id, pool="rollout").set(report.version)
        return {"version": report.version, "bytes": report.nbytes, "seconds": report.seconds}

    def parameters(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Copies of the served weights by HF name (native engine only; for checks and debugging)."""
        return self.engine.parameters(names)

    def policy_version(self) -> int:
        return self.engine.policy_version

    def shutdown(self) -> None:
        self._control.stop(0)
        if self.client is not None:
            self.client.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        self.engine.shutdown()
