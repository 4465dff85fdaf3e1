"""Run a sparrow bench command with candidate kernel defaults switched on: fused merge, selection early exit."""
import runpy
import sys

from sparrow.kernels.triton import backend, selection

variant = sys.argv[1]
if variant in ("fused", "both"):
    backend.TritonBackend.__init__.__defaults__ = (None, None, True)
if variant in ("early", "both"):
    selection.select_blocks.__kwdefaults__["early_exit"] = True
print("variant", variant, backend.TritonBackend().fused_merge, selection.select_blocks.__kwdefaults__, flush=True)
sys.argv = ["bench"] + sys.argv[2:]
runpy.run_module("sparrow.rollout_workers.native.bench", run_name="__main__")
