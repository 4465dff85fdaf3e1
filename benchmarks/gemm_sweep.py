"""Decode projections of the Qwen3-1.7B shape at batch 8 and 32: cuBLAS (F.linear) against the Triton
weight-streaming GEMM over a few tilings. CUDA-graph replays, cold L2; prints a table last.

Usage (CUDA machine, repo root): python benchmarks/gemm_sweep.py [out.json]
"""

import json
import sys

import torch
from torch.nn import functional as F

from sparrow.kernels.triton.bench import _bench, _graph, copy_bandwidth
from sparrow.kernels.triton.skinny_gemm import GemmTiling, skinny_linear
from sparrow.tables import format_table

SHAPES = {"qkv": (4096, 2048), "o": (2048, 2048), "gate_up": (12288, 2048), "down": (2048, 6144)}  # (N, K)
TILINGS = [GemmTiling(16, 512, 4, 4), GemmTiling(32, 256, 4, 4), GemmTiling(32, 512, 4, 3), GemmTiling(64, 256, 4, 4),
           GemmTiling(16, 256, 4, 6), GemmTiling(64, 128, 4, 6), GemmTiling(32, 256, 8, 5), GemmTiling(16, 1024, 4, 3)]


def main(out: str | None = None) -> None:
    copy = copy_bandwidth()
    rows = []
    for batch in (8, 32):
        for name, (n_dim, k_dim) in SHAPES.items():
            gen = torch.Generator(device="cuda").manual_seed(n_dim + k_dim)
            x = torch.randn(batch, k_dim, device="cuda", generator=gen).bfloat16()
            w = (torch.randn(n_dim, k_dim, device="cuda", generator=gen) * 0.02).bfloat16()
            expect = F.linear(x.float(), w.float())
            mb = w.numel() * 2 / 1e6
            variants = [("cublas", lambda: F.linear(x, w))]
            variants += [(f"triton {t.block_n}x{t.block_k} w{t.num_warps} s{t.num_stages}",
                          lambda t=t: skinny_linear(x, w, tiling=t)) for t in TILINGS]
            for label, fn in variants:
                try:
                    err = ((fn().float() - expect).norm() / expect.norm()).item()
                    us = _bench(_graph(fn), 40)
                except Exception as exc:  # a tiling that does not compile (shared memory) is reported, not fatal
                    print(f"{name} b{batch} {label}: {exc!r}"[:300], flush=True)
                    continue
                rows.append({"batch": batch, "proj": name, "variant": label, "us": us, "weight_MB": mb,
                             "pct_copy": 100 * mb * 1e6 / (us * 1e-6) / (copy * 1e9), "rel_err": err})
                print(rows[-1], flush=True)
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "copy_GBps": copy, "rows": rows}, f, indent=1)
    print(f"copy {copy:.0f} GB/s")
    table = []
    for batch in (8, 32):
        for name in SHAPES:
            mine = [r for r in rows if r["batch"] == batch and r["proj"] == name]
            blas = next((r for r in mine if r["variant"] == "cublas"), None)
            best = min((r for r in mine if r["variant"] != "cublas"), key=lambda r: r["us"], default=None)
            if blas and best:
                table.append([batch, name, f"{blas['us']:.1f}", f"{blas['pct_copy']:.0f}", best["variant"],
                              f"{best['us']:.1f}", f"{best['pct_copy']:.0f}", f"{best['rel_err']:.1e}"])
    print(format_table(["batch", "proj", "cublas us", "% copy", "best triton", "us", "% copy", "rel err"], table))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
