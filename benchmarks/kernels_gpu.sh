#!/usr/bin/env bash
# One GPU session for the Triton decode kernels: GPU correctness tests, then `sparrow bench kernels`.
# Usage (repo root, CUDA machine): benchmarks/kernels_gpu.sh [bench options]; logs and JSON go to $OUT.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
OUT=${OUT:-/tmp/sparrow-kernels}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest tests/test_triton_kernels.py -m gpu -q -p no:cacheprovider -rfE 2>&1 | tee "$OUT/tests.log"
python3 -m sparrow.bench.decode_kernels --out "$OUT/kernels.json" "$@" 2>&1 | tee "$OUT/bench.log"
