#!/usr/bin/env bash
# One GPU session for the native engine: GPU tests (engine + Triton kernels), the block-selection sweep (stage
# `select`, opt-in), `bench decode-step` (and over FP8 KV pages: stage `decode-fp8`, opt-in), `bench rollout-paper`.
# Usage (repo root, CUDA machine): benchmarks/engine_gpu.sh [rollout-paper options]; logs and JSON go to $OUT.
# Each stage has a time cap, so one that hangs or runs long leaves the others their time; STAGES picks stages.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
OUT=${OUT:-/tmp/sparrow-engine}
TESTS_S=${TESTS_S:-200} SELECT_S=${SELECT_S:-150} DECODE_S=${DECODE_S:-150} ROLLOUT_S=${ROLLOUT_S:-300}
STAGES=${STAGES:-"tests decode rollout"}
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log -1 --format='commit %H' 2>/dev/null; } | tee "$OUT/gpu.txt"
[[ " $STAGES " == *" tests "* ]] && timeout "$TESTS_S" python3 -m pytest tests/test_engine_cuda.py tests/test_triton_kernels.py -m gpu -q -p no:cacheprovider \
  -rfE 2>&1 | tee "$OUT/tests.log"
[[ " $STAGES " == *" select "* ]] && timeout "$SELECT_S" python3 benchmarks/select_sweep.py "$OUT/select-sweep.json" 2>&1 \
  | tee "$OUT/select-sweep.log"
[[ " $STAGES " == *" decode "* ]] && timeout "$DECODE_S" python3 -m sparrow.bench.rollout decode-step --out "$OUT/decode-step.json" 2>&1 \
  | tee "$OUT/decode-step.log"
[[ " $STAGES " == *" decode-fp8 "* ]] && timeout "$DECODE_S" python3 -m sparrow.bench.rollout decode-step \
  --kv-cache-dtype fp8_e4m3 --out "$OUT/decode-step-fp8.json" 2>&1 | tee "$OUT/decode-step-fp8.log"
[[ " $STAGES " == *" rollout "* ]] && timeout "$ROLLOUT_S" python3 -m sparrow.bench.rollout rollout-paper --out "$OUT/rollout-paper.json" "$@" 2>&1 \
  | tee "$OUT/rollout-paper.log"
