#!/usr/bin/env bash
# Session 14 (2026-11-29): the sample record moved to the host per step; 8B 32K protocol at batch 24 re-measured.
set -uo pipefail
source benchmarks/gpu_env.sh
T0=$SECONDS
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" > $OUT/versions.txt
step() { echo "$1 rc $2 at $((SECONDS-T0)) s" | tee -a $OUT/progress-$CALL.txt; }
case $CALL in
  check)
    timeout 170 python3 -m pytest tests/test_engine_cuda.py tests/test_engine_overlap.py tests/test_triton_kernels.py -m gpu -k "not test_triton_kernels or (fp8 and int8)" -q -p no:cacheprovider -rfE > $OUT/gpu-tests.log 2>&1
    step tests $?
    tail -4 $OUT/gpu-tests.log
    timeout 400 benchmarks/rollout_protocol_gpu.sh qwen3-8b sparse 24 --overlap-decode --replayed 2 > /dev/null; step sparse8b $?
    tail -8 $OUT/rollout-qwen3-8b-b24-sparse.log ;;
  sparseint8) timeout 585 benchmarks/rollout_protocol_gpu.sh qwen3-8b sparse 24 --overlap-decode --replayed 2 --landmark mean_int8 > /dev/null; step sparseint8 $?; tail -8 $OUT/rollout-qwen3-8b-b24-sparse.log ;;
  dense1) END_STEP=22016 timeout 585 benchmarks/rollout_protocol_gpu.sh qwen3-8b dense 24 --overlap-decode --replayed 1 > /dev/null; step dense1 $?; tail -6 $OUT/*.log ;;
  dense2) START_STEP=22016 timeout 585 benchmarks/rollout_protocol_gpu.sh qwen3-8b dense 24 --overlap-decode --replayed 1 > /dev/null; step dense2 $?; tail -6 $OUT/*.log ;;
esac
