"""Split-K count against batch size: a whole dense decode layer (attention + merge) and a whole sparse one (score,
select, attention, merge; 2048-token budget) at 32K context, bfloat16 and FP8 pages, 8 KV heads, D = 128, G = 4, every
power-of-two split count, beside the count `choose_splits` picks. CUDA-graph replays, cold L2; prints a table per
page format and writes JSON after every batch (a run cut short keeps what it measured).

Usage (CUDA machine, repo root): python benchmarks/splits_sweep.py [out.json]
"""

import json
import math
import sys

import torch

from sparrow.bench.cuda_timing import DEVICE, graph_replay, median_us
from sparrow.bench.decode_kernels.cases import Pool, make_case
from sparrow.kernels import SparseAttentionConfig
from sparrow.kernels.triton.attention import attention_tiling
from sparrow.kernels.triton.backend import MAX_SPLITS, TritonBackend, choose_splits
from sparrow.layout import BLOCK_SIZE
from sparrow.tables import format_table

BATCHES, CONTEXT, HEADS, DIM, GROUP, BUDGET_TOKENS = (8, 16, 24, 32, 40, 48, 56, 64), 32768, 8, 128, 4, 2048
SPLITS = [1 << k for k in range(MAX_SPLITS.bit_length())]


def layer_times(pool: Pool, batch: int, splits: int, tiling, config: SparseAttentionConfig) -> tuple[float, float]:
    case = make_case(pool, batch, CONTEXT, GROUP, HEADS, DIM, seed=batch)
    backend = TritonBackend(splits=splits, tiling=tiling)
    backend.prepare(batch, case.tables.shape[1], HEADS * GROUP, HEADS, DIM, DEVICE)
    budgets = torch.full((batch,), BUDGET_TOKENS // BLOCK_SIZE, dtype=torch.int32, device=DEVICE)

    def layer(landmarks, budget):
        return lambda: backend.decode(case.q, pool.k, pool.v, landmarks, case.tables, case.seq_lens, budget, config,
                                      DIM**-0.5, pool.scales)

    return median_us(graph_replay(layer(None, None)), 40), median_us(graph_replay(layer(pool.mean, budgets)), 40)


def main(out: str | None = None) -> None:
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    config, rows = SparseAttentionConfig(), []
    for kv_cache_dtype in ("fp8_e4m3", "auto"):
        fp8 = kv_cache_dtype != "auto"
        pool = Pool(math.ceil(max(BATCHES) * CONTEXT / BLOCK_SIZE) + 64, HEADS, DIM, kv_cache_dtype)
        table = []
        for batch in BATCHES:
            chosen = choose_splits(batch * HEADS, sms, fp8)
            times = {s: layer_times(pool, batch, s, attention_tiling(DIM, fp8), config) for s in SPLITS}
            rows += [{"kv_cache_dtype": kv_cache_dtype, "batch": batch, "splits": s, "chosen": chosen,
                      "dense_us": d, "sparse_us": sp} for s, (d, sp) in times.items()]
            best = min(times, key=lambda s: times[s][0])
            table.append([batch, chosen, f"{times[chosen][0]:.1f}", best, f"{times[best][0]:.1f}",
                          f"{times[chosen][1]:.1f}", f"{min(t[1] for t in times.values()):.1f}"]
                         + [f"{d:.0f} / {sp:.0f}" for d, sp in times.values()])
            if out:
                with open(out, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(0), "num_sms": sms, "rows": rows}, f, indent=1)
            torch.cuda.empty_cache()
        del pool
        torch.cuda.empty_cache()
        print(f"\n{kv_cache_dtype} pages, {CONTEXT}-token context, G = {GROUP}, sparse budget {BUDGET_TOKENS} tokens (us)")
        print(format_table(["batch", "chosen", "dense us", "fastest", "dense us", "sparse us", "fastest sparse"]
                           + [f"s{s} dense / sparse" for s in SPLITS], table))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
