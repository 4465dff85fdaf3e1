"""Block selection alone at the Table 4 decode shape (batch 8 × 8 KV heads, 1024-token budget), per
launch variant: bisection bits per pass × warps. CUDA-graph replays, cold L2; prints a table last.

Usage (CUDA machine, repo root): python benchmarks/select_sweep.py [out.json]
"""

import json
import sys

import torch

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
        expect = None
        for bits in (2, 4):
            for warps in (4, 8, 16):
                def run(bits=bits, warps=warps):
                    select_blocks(scores, tables, lens, budgets, selected, counts, num_kv_heads=HEADS, block_size=BS,
                                  sink=1, recent=2, bits=bits, num_warps=warps)
                selected.fill_(-1)
                run()
                got = selected[:, :BUDGET].sort(dim=1).values.cpu()
                expect = got if expect is None else expect
                us = _bench(_graph(run), 40)
                rows.append({"context": context, "width": width, "bits": bits, "warps": warps, "us": us,
                             "same_as_first": bool(torch.equal(got, expect))})
                print(rows[-1], flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print(format_table(["context", "width", "bits", "warps", "select us", "same"],
                       [[r["context"], r["width"], r["bits"], r["warps"], f"{r['us']:.1f}", r["same_as_first"]]
                        for r in rows]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
