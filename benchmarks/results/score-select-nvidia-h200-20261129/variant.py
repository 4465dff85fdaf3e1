"""Run a sparrow bench command with TritonBackend(fused_selection=<variant == 'fused'>) as the default."""
import runpy
import sys

from sparrow.kernels.triton import backend

variant = sys.argv[1]
backend.TritonBackend.__init__.__defaults__ = (None, None, variant == "fused")
print("variant", variant, "fused_selection", backend.TritonBackend().fused_selection, flush=True)
sys.argv = ["bench"] + sys.argv[2:]
runpy.run_module("sparrow.rollout_workers.native.bench", run_name="__main__")
