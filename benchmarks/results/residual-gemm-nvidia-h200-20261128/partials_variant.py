"""Run a sparrow bench command with the residual projections switched: 'cublas' (no partials) or a tiling 'N,K,P,W,S'."""
import runpy
import sys

from sparrow.kernels.triton import fused, residual_gemm

variant = sys.argv[1]
if variant == "cublas":
    fused.PARTIALS_MAX_ROWS = 0
elif variant != "default":
    residual_gemm.linear_partials.__defaults__ = (False, residual_gemm.SplitKTiling(*map(int, variant.split(","))))
print("variant", variant, fused.PARTIALS_MAX_ROWS, residual_gemm.linear_partials.__defaults__, flush=True)
sys.argv = ["bench"] + sys.argv[2:]
runpy.run_module("sparrow.rollout_workers.native.bench", run_name="__main__")
