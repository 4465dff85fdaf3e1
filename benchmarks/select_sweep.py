"""Block selection alone at the Table 4 decode shape (batch 8 × 8 KV heads, 1024-token budget), per warp
count, with and without the bisection's early exit (`select_blocks(early_exit=)`), checked against the reference
selection. CUDA-graph replays, cold L2; prints a table last.

Usage (CUDA machine, repo root): python benchmarks/select_sweep.py [out.json]
"""

import json
import sys

import torch

from sparrow.kernels import reference as ref
from sparrow.kernels.triton.bench import _bench, _graph
from sparrow.kernels.triton.selection import select_blocks
from sparrow.tables import format_table

BATCH, HEADS, BS, BUDGET = 8, 8, 16, 64


def main(out: str | None = None) -> None:
    rows = []
    for context in (16385, 24577, 32769):
        n = -(-context // BS)
        width = max(16, 1 << (n - 1).bit_length())  # the engine's table-width bucket
        gen = torch.Generator(device="cuda").manual_seed(context)
        scores = torch.randn(BATCH * HEADS, width, device="cuda", generator=gen)
        tables = torch.randperm(BATCH * width, device="cuda", generator=gen).view(BATCH, width).int()
        lens = torch.full((BATCH,), context, dtype=torch.int32, device="cuda")
        budgets = torch.full((BATCH,), BUDGET, dtype=torch.int32, device="cuda")
        selected = torch.empty(BATCH * HEADS, width, dtype=torch.int32, device="cuda")
        counts = torch.empty(BATCH, dtype=torch.long, device="cuda")
        ids, _ = ref.select_blocks(scores.view(BATCH, HEADS, -1), torch.full((BATCH,), n, device="cuda"), budgets, 1, 2)
        expect = torch.gather(tables.long()[:, None, :].expand(-1, HEADS, -1), 2, ids.clamp(min=0)).view(BATCH * HEADS, -1)
        expect = expect.sort(dim=1).values.cpu()
        for warps in (4, 8, 16):
            for early_exit in (False, True):
                def run(warps=warps, early_exit=early_exit):
                    select_blocks(scores, tables, lens, budgets, selected, counts, num_kv_heads=HEADS, block_size=BS,
                                  sink=1, recent=2, num_warps=warps, early_exit=early_exit)
                selected.fill_(-1)
                run()
                exact = torch.equal(selected[:, :BUDGET].long().sort(dim=1).values.cpu(), expect)
                us = _bench(_graph(run), 40)
                rows.append({"context": context, "width": width, "warps": warps, "early_exit": early_exit, "us": us,
                             "equals_reference": exact})
                print(rows[-1], flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(format_table(["context", "width", "warps", "early exit", "select us", "= reference"],
                       [[r["context"], r["width"], r["warps"], r["early_exit"], f"{r['us']:.1f}", r["equals_reference"]]
                        for r in rows]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
