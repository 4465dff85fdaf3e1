"""Benchmarks of the native engine: `sparrow bench rollout` and `rollout-merge` (end-to-end rollout throughput,
dense vs sparse, `rollout.py`) and the GPU ones, `decode-step` and `rollout-paper`.

decode-step: the full-model decode step at the points of Sparrow's Table 4 (one GPU, batch 8, past KV
16K / 24K / 32K, a 1024-token budget), dense and sparse, replayed from the engine's CUDA graphs. The KV
cache is filled directly with random values (speed does not depend on them), every sequence's block
table is a random slice of the pool, and the time is the median over many replays, next to the
bytes-moved floor at the copy bandwidth measured in the same run.

rollout-paper: the paper's rollout protocol (8 samples per prompt, generation forced to 32K tokens,
dense vs the 0.86 schedules) on one GPU, in two parts per model:
  (a) a real end-to-end run of the engine (continuous batching, prefill, sampling, CUDA graphs) at a
      shorter generation whose contexts cross several schedule bins;
  (b) a projection to the 32K protocol from measured step times: graph-replayed decode steps (model +
      sampler) at contexts spread over 0–32K on a filled cache, at the batch the protocol implies (the
      most groups of 8 whose 32K KV fits), integrated over the generation. The same step times,
      integrated over (a)'s range, predict (a)'s decode time: that comparison is the projection's check.
"""

from .decode_step import run_decode_step
from .floor import byte_floor_speedup, step_bytes
from .rollout_paper import run_rollout_paper

__all__ = ["byte_floor_speedup", "run_decode_step", "run_rollout_paper", "step_bytes"]
