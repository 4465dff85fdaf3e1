"""The measured speedup: the same requests generated sparse, then dense, on one otherwise idle engine.

The first probe of each mode on an engine runs its requests once untimed first: a fresh engine captures CUDA
graphs and compiles kernels for each shape it meets on first use, and timing that pass made a dense-vs-dense
probe read 0.49 on a GPU (its first pass took twice as long as the second).
"""

import time

from sparrow.rollout_workers.api import RolloutEngine, RolloutRequest

from .work_queue import ProbeResult


def measure_speedup(engine: RolloutEngine, requests: list[RolloutRequest], warmed: set[str]) -> ProbeResult:
    """Tokens per second under the engine's schedule and dense; `warmed` holds the modes already run once
    on this engine (updated here). The engine's schedule is restored."""
    schedule = engine.schedule
    rates = []
    try:
        for s in (schedule, None):
            engine.set_schedule(s)
            mode = "dense" if s is None else "sparse"
            if mode not in warmed:
                engine.generate(requests)
                warmed.add(mode)
            start = time.perf_counter()
            tokens = sum(int(x.token_ids.numel()) for x in engine.generate(requests))
            rates.append(tokens / (time.perf_counter() - start))
    finally:
        engine.set_schedule(schedule)
    return ProbeResult(*rates)
