"""The decode step's weight GEMMs (x [M, K] @ W[N, K]^T, bf16; M = the decode batch) under one BLAS setting, to see
whether cuBLASLt or a workspace setting beats PyTorch's default cuBLAS at rollout batch sizes. Each shape is timed
as a CUDA graph of 24 GEMMs over distinct weight copies (each read from HBM, as the model's layers are), median of 20
replays, µs per GEMM and % of 4.29 TB/s on the weight bytes: one JSON line to stdout, the same as a table to stderr.

Usage (CUDA machine; workspace variables must be set before torch starts, so one process per setting):
  python benchmarks/gemm_blas.py default
  CUBLAS_WORKSPACE_CONFIG=:0:0 python benchmarks/gemm_blas.py cublas-no-workspace
  python benchmarks/gemm_blas.py lt                                   # torch.backends.cuda.preferred_blas_library("cublaslt")
  CUBLASLT_WORKSPACE_SIZE=0 python benchmarks/gemm_blas.py lt-no-workspace
"""

import json
import os
import sys

import torch

from sparrow.tables import format_table

SHAPES = {  # name: (M, N, K) of Qwen3-1.7B at batch 8, Qwen3-4B at 24, Qwen3-8B at 40 (fused qkv and gate/up)
    "1.7b qkv": (8, 4096, 2048), "1.7b o": (8, 2048, 2048), "1.7b gate_up": (8, 12288, 2048), "1.7b down": (8, 2048, 6144),
    "4b qkv": (24, 6144, 2560), "4b o": (24, 2560, 4096), "4b gate_up": (24, 19456, 2560), "4b down": (24, 2560, 9728),
    "8b qkv b40": (40, 6144, 4096), "8b o b40": (40, 4096, 4096), "8b gate_up b40": (40, 24576, 4096),
    "8b down b40": (40, 4096, 12288),
}
COPIES, REPLAYS, COPY_BPS = 24, 20, 4.29e12


def main(setting: str) -> None:
    if setting.startswith("lt"):
        torch.backends.cuda.preferred_blas_library("cublaslt")
    dev = torch.device("cuda")
    out = {"setting": setting, "env": {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "CUBLASLT_WORKSPACE_SIZE")},
           "blas": str(torch.backends.cuda.preferred_blas_library()), "us": {}}
    for name, (m, n, k) in SHAPES.items():
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for _ in range(COPIES)]
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        ys = [torch.nn.functional.linear(x, w) for w in weights]  # warm-up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i, w in enumerate(weights):
                ys[i] = torch.nn.functional.linear(x, w)
        times = []
        for _ in range(REPLAYS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / COPIES)
        us = sorted(times)[REPLAYS // 2]
        out["us"][name] = {"us": round(us, 2), "pct_of_4.29TBps": round(n * k * 2 / COPY_BPS * 1e6 / us * 100, 1)}
        del weights, ys, graph
        torch.cuda.empty_cache()
    print(json.dumps(out))
    print(format_table(["shape", f"{setting} us", "% of 4.29 TB/s"],
                       [[name, f"{r['us']:.2f}", f"{r['pct_of_4.29TBps']:.0f}"] for name, r in out["us"].items()]),
          file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1])
