"""Run a sparrow bench command with the sparse layers' split-K count forced (dense layers keep the rule)."""
import runpy
import sys

from sparrow.kernels.triton import backend

forced = int(sys.argv[1])
rule_decode_attention = backend.decode_attention


def forced_splits(*args, **kwargs):
    if kwargs.get("budgets") is not None and forced:
        kwargs["splits"] = forced
    return rule_decode_attention(*args, **kwargs)


backend.decode_attention = forced_splits
print("sparse-layer splits forced to", forced or "the rule", flush=True)
sys.argv = ["bench"] + sys.argv[2:]
runpy.run_module("sparrow.rollout_workers.native.bench", run_name="__main__")
