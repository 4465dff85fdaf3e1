#!/usr/bin/env bash
# One arm of the stability study (docs/stability.md) on a GPU machine where Sparrow is not installed: the repo's
# folders become the `sparrow.*` packages through symlinks and PYTHONPATH (setup.py's FOLDERS), then
# benchmarks/stability_study.py runs with the given options.
# Usage (repo root): benchmarks/stability_gpu.sh --arm b --config deploy/configs/smollm2-longctx-h200.yaml ...
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
if ! python3 -c "import pydantic" 2>/dev/null && [ -d .whl ]; then  # wheels carried to a machine without an index
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! python3 -c "import sparrow.coordinator.driver" 2>/dev/null; then
  for pkg in kernels rollout_workers trainer coordinator protos; do [ -e "sparrow/$pkg" ] || ln -s "../$pkg" "sparrow/$pkg"; done
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
exec python3 benchmarks/stability_study.py "$@"
