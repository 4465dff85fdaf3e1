"""The decode step's sampler, eager PyTorch ops vs the fused Triton kernel, on CUDA: T = 1, top-20 logprobs, one
noise seed per row, float32 logits of Qwen3's 151,936-token vocabulary, at rollout batch sizes. Each round queues
ITERS samplings behind a ~50 ms GPU sleep, so the host is ahead of the GPU as in the engine's overlapped loop (where
a decode step's graph runs while the sampler is launched) and the CUDA events measure GPU time, not launch time;
the median µs per sampling over the rounds, beside the floor (one read of the logits at 4.29 TB/s). Prints a table;
one JSON line to stdout.

Usage (CUDA machine): python benchmarks/sampler_bench.py [batch ...]   (default 8 16 24 32 40)
"""

import json
import sys

import torch

from sparrow.rollout_workers.api import SamplingParams
from sparrow.rollout_workers.native.sampler import SamplingBatch, sample_eager, sample_fused
from sparrow.tables import format_table

VOCAB, ITERS, ROUNDS, COPY_BPS, SLEEP_CYCLES = 151_936, 20, 7, 4.29e12, 100_000_000


def time_us(fn, logits, batch) -> float:
    fn(logits, batch)  # compile / warm up
    torch.cuda.synchronize()
    rounds = []
    for _ in range(ROUNDS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        for _ in range(ITERS):
            fn(logits, batch)
        end.record()
        torch.cuda.synchronize()
        rounds.append(start.elapsed_time(end) * 1e3 / ITERS)
    return sorted(rounds)[len(rounds) // 2]


def main(batches: list[int]) -> None:
    rows, out = [], {"device": torch.cuda.get_device_name(), "vocab": VOCAB, "points": []}
    for b in batches:
        logits = torch.randn(b, VOCAB, device="cuda") * 4
        batch = SamplingBatch.build([SamplingParams(temperature=1.0, logprobs=20)] * b, list(range(b)),
                                    [1000] * b, "cuda")
        eager, fused = time_us(sample_eager, logits, batch), time_us(sample_fused, logits, batch)
        floor = b * VOCAB * 4 / COPY_BPS * 1e6
        out["points"].append({"batch": b, "eager_us": eager, "fused_us": fused, "floor_us": floor})
        rows.append([b, f"{eager:.1f}", f"{fused:.1f}", f"{eager / fused:.1f}x", f"{floor:.1f}"])
    print(format_table(["batch", "eager us", "fused us", "speedup", "floor us"], rows), file=sys.stderr)
    print(json.dumps(out))


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [8, 16, 24, 32, 40])
