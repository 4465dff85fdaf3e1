"""Block selection alone at the Table 4 decode shape (batch 8 × 8 KV heads, 1024-token budget), at the Qwen3-4B
protocol's (batch 24 × 8 KV heads, the 0.86 schedule's 384 blocks at 32K) and at the Qwen3-8B protocol's with FP8 pages
(batch 40, 320 blocks), per warp count, checked against the reference selection. CUDA-graph replays, cold L2; prints a
table last.

Usage (CUDA machine, repo root): python benchmarks/select_sweep.py [out.json]
"""

import itertools
import json
import sys

import torch

from sparrow.bench.cuda_timing import graph_replay, median_us
from sparrow.kernels import reference as ref
from sparrow.kernels.triton.selection import select_blocks
from sparrow.tables import format_table

HEADS, BS = 8, 16
SHAPES = ((8, 64), (24, 384), (40, 320))  # (batch, budget in blocks)


def main(out: str | None = None) -> None:
    rows = []
    for (batch, budget), context in itertools.product(SHAPES, (16385, 24577, 32769)):
        n = -(-context // BS)
        width = max(16, 1 << (n - 1).bit_length())  # the engine's table-width bucket
        gen = torch.Generator(device="cuda").manual_seed(context)
        scores = torch.randn(batch * HEADS, width, device="cuda", generator=gen)
        tables = torch.randperm(batch * width, device="cuda", generator=gen).view(batch, width).int()
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        budgets = torch.full((batch,), budget, dtype=torch.int32, device="cuda")
        selected = torch.empty(batch * HEADS, width, dtype=torch.int32, device="cuda")
        counts = torch.empty(batch, dtype=torch.long, device="cuda")
        ids, _ = ref.select_blocks(scores.view(batch, HEADS, -1), torch.full((batch,), n, device="cuda"), budgets, 1, 2)
        expect = torch.gather(tables.long()[:, None, :].expand(-1, HEADS, -1), 2, ids.clamp(min=0)).view(batch * HEADS, -1)
        expect = expect.sort(dim=1).values.cpu()
        for warps in (1, 2, 4, 8, 16):
            def run(warps=warps):
                select_blocks(scores, tables, lens, budgets, selected, counts, num_kv_heads=HEADS, block_size=BS,
                              sink=1, recent=2, num_warps=warps)
            selected.fill_(-1)
            run()
            exact = torch.equal(selected[:, :budget].long().sort(dim=1).values.cpu(), expect)
            us = median_us(graph_replay(run), 40)
            rows.append({"batch": batch, "budget": budget, "context": context, "width": width, "warps": warps,
                         "us": us, "equals_reference": exact})
            print(rows[-1], flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(format_table(["batch", "budget", "context", "width", "warps", "select us", "= reference"],
                       [[r["batch"], r["budget"], r["context"], r["width"], r["warps"], f"{r['us']:.1f}",
                         r["equals_reference"]] for r in rows]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
