#!/usr/bin/env bash
# One GPU session for the Triton decode kernels: GPU correctness tests, then `sparrow bench kernels`.
# Usage (repo root, CUDA machine): benchmarks/kernels_gpu.sh [bench options]; logs and JSON go to $OUT.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
OUT=${OUT:-/tmp/sparrow-kernels}
mkdir -p "$OUT"
if ! python3 -c "import sparrow.kernels" 2>/dev/null; then
  # Not installed: the repo's kernels/ folder is the package sparrow.kernels (see setup.py).
  [ -e sparrow/kernels ] || ln -s ../kernels sparrow/kernels
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest tests/test_triton_kernels.py -m gpu -q -p no:cacheprovider -rfE 2>&1 | tee "$OUT/tests.log"
python3 -m sparrow.kernels.bench_cli --out "$OUT/kernels.json" "$@" 2>&1 | tee "$OUT/bench.log"
