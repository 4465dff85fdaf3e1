"""A KV cache filled with random values, decoded from the engine's CUDA graphs at any context."""

import gc

import torch

from sparrow.kernels import SparseAttentionConfig
from sparrow.kernels.reference import FP8_KV_DTYPE
from sparrow.rollout_workers.api import SamplingParams
from sparrow.rollout_workers.native.cuda_graphs import DecodeGraphs, DecodeStep
from sparrow.rollout_workers.native.kv_cache import KVCache, bytes_per_block
from sparrow.rollout_workers.native.model import DecoderModel
from sparrow.rollout_workers.native.sampler import SamplingBatch, sample

from .breakdown import kernel_kinds


def free_gpu_memory() -> int:
    """Free device memory once everything unreferenced is released (PyTorch's cache included)."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


class FilledDecode:
    """`batch` sequences whose KV cache (every layer) and landmarks hold random values up to `max_len`
    tokens; each block table is a random slice of the pool, as in a long-running engine. Decode steps at
    any context ≤ max_len replay from the engine's `DecodeGraphs`, then sample (T = 1, top-20 logprobs)."""

    def __init__(self, model: DecoderModel, attention: SparseAttentionConfig, batch: int, max_len: int, seed: int = 0,
                 kv_cache_dtype: str = "auto"):
        self.attention, self.batch = attention, batch
        self.max_blocks = attention.blocks_for(max_len)
        num_blocks = batch * self.max_blocks + 1
        need = num_blocks * bytes_per_block(model.spec, attention, model.dtype, kv_cache_dtype)
        free = free_gpu_memory()
        if need > 0.97 * free:
            raise ValueError(f"{batch} sequences of {max_len} tokens need {need / 1e9:.1f} GB of KV cache, "
                             f"{free / 1e9:.1f} GB are free; lower the batch or the length")
        self.cache = KVCache(model.spec, attention, num_blocks, model.dtype, model.device, kv_cache_dtype)
        gen = torch.Generator(device=model.device).manual_seed(seed)
        for t in (self.cache.k, self.cache.v, self.cache.landmarks):
            if t.dtype == FP8_KV_DTYPE:  # random finite e4m3 bytes (0x7f is NaN), positive up to 448
                t.view(torch.uint8).random_(0, 0x7F, generator=gen)
            elif t.dtype == torch.int8:  # mean_int8 rows: random steps, then the float32 scale after the D values
                t.random_(-127, 128, generator=gen)
                t.view(torch.float32)[..., model.spec.head_dim // 4].uniform_(0.01, 0.02, generator=gen)
            else:
                t.normal_(generator=gen)
        for t in (self.cache.k_scale, self.cache.v_scale):
            if t is not None:
                t.uniform_(0.0, 2 / 448, generator=gen)
        cpu = torch.Generator().manual_seed(seed)
        perm = torch.randperm(num_blocks, generator=cpu)
        self.tables = [perm[r * self.max_blocks : (r + 1) * self.max_blocks].tolist() for r in range(batch)]
        self.use_model(model)
        self.token_ids = torch.randint(0, model.spec.vocab_size, (batch,), generator=cpu).tolist()
        params = [SamplingParams(temperature=1.0, logprobs=20)] * batch
        self.sampling = SamplingBatch.build(params, list(range(batch)), [max_len] * batch, model.device)

    def use_model(self, model: DecoderModel) -> None:
        """Decode with `model` (of the cache's shape) over the filled cache: new graphs, same block tables."""
        from sparrow.kernels.triton import TritonBackend

        self.graphs = None  # the previous model's graphs go before the new ones are captured
        self.graphs = DecodeGraphs(model, self.cache, TritonBackend(), self.attention, self.batch, self.max_blocks)
        for row, table in enumerate(self.tables):
            self.graphs.write_table(row, table)
        gc.collect()

    def drop_model(self) -> int:
        """Release the graphs and with them the model they hold, so that another model fits beside the cache;
        returns the free device memory then."""
        self.graphs = None
        return free_gpu_memory()

    def stage(self, context: int, sparse: bool) -> DecodeStep:
        bs = self.attention.block_size
        current = [t[(context - 1) // bs] for t in self.tables]
        return self.graphs.stage(list(range(self.batch)), self.token_ids, [context] * self.batch, current, sparse)

    def time(self, context: int, sparse: bool, replays: int) -> dict:
        """Median ms of the graph replay, of the sampler after it, and of both, over `replays` steps."""
        step = self.stage(context, sparse)
        step.replay()
        sample(step.logits[: self.batch], self.sampling)
        torch.cuda.synchronize()
        marks = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(replays)]
        for start, mid, end in marks:
            start.record()
            step.replay()
            mid.record()
            sample(step.logits[: self.batch], self.sampling)
            end.record()
        torch.cuda.synchronize()

        def median(values):
            return sorted(values)[len(values) // 2]

        return {"step_ms": median([s.elapsed_time(m) for s, m, _ in marks]),
                "sample_ms": median([m.elapsed_time(e) for _, m, e in marks]),
                "total_ms": median([s.elapsed_time(e) for s, _, e in marks])}

    def release(self) -> None:
        del self.graphs, self.cache
        gc.collect()
        torch.cuda.empty_cache()


def profile_kernels(step: DecodeStep, top: int = 12) -> dict:
    """Kernels of one replay (CUPTI sees the kernels inside a graph): count, summed GPU time, the largest, their sums
    per group (`breakdown.kernel_kinds`), and the idle time between consecutive kernels by the pair of kernels around
    it (`kernel_gaps`)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step.replay()
        torch.cuda.synchronize()
    kernels = [k for k in prof.key_averages() if k.device_type == DeviceType.CUDA]

    def us(k):
        return getattr(k, "self_device_time_total", None) or getattr(k, "self_cuda_time_total", 0.0)

    kernels.sort(key=us, reverse=True)
    timeline = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == DeviceType.CUDA]
    return {"kernels": sum(k.count for k in kernels), "kernel_us": sum(us(k) for k in kernels),
            "top": [{"name": k.key[:90], "count": k.count, "us": us(k)} for k in kernels[:top]],
            "kinds": kernel_kinds([(k.key, k.count, us(k)) for k in kernels]), **kernel_gaps(timeline, top)}


def kernel_gaps(timeline: list[tuple[str, float, float]], top: int = 12) -> dict:
    """Idle GPU time inside one replay from kernels' `(name, start_us, end_us)`: the span from the first start to the
    last end, the summed gaps between a kernel's end and the next one's start (overlaps count as none), and the
    pairs (kernel before, kernel after) with the most of it, so a launch change shows which edges it shortens."""
    ordered = sorted(timeline, key=lambda k: k[1])
    pairs: dict[tuple[str, str], list[float]] = {}
    busy_until = ordered[0][2] if ordered else 0.0
    for (before, _, _), (after, start, end) in zip(ordered, ordered[1:]):
        pairs.setdefault((before[:60], after[:60]), []).append(max(0.0, start - busy_until))
        busy_until = max(busy_until, end)
    edges = sorted(pairs.items(), key=lambda kv: sum(kv[1]), reverse=True)
    return {"span_us": ordered[-1][2] - ordered[0][1] if ordered else 0.0,
            "gap_us": sum(sum(g) for g in pairs.values()),
            "gaps": [{"before": b, "after": a, "count": len(g), "us": sum(g)} for (b, a), g in edges[:top]]}
