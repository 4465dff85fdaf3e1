#!/usr/bin/env bash
# Int8 landmarks on one H200 (2026-11-29, session 13): five nvidia-h200 calls on one machine kept warm between them,
# CALL=check (GPU tests + decode-step, mean vs mean_int8), sparse8b (int8 landmarks), sparse8bmean (mean), dense1, dense2.
# The sparse runs wrote rollout-qwen3-8b-b24-sparse.*, renamed here -int8 / -mean.
set -uo pipefail
source benchmarks/gpu_env.sh
T0=$SECONDS
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" > $OUT/versions.txt
step() { echo "$1 rc $2 at $((SECONDS-T0)) s" | tee -a $OUT/progress-$CALL.txt; }
case $CALL in
  check)
    timeout 150 python3 -m pytest tests/test_triton_kernels.py tests/test_engine_cuda.py -m gpu -k "int8 or fp8 or graph" -q -p no:cacheprovider -rfE > $OUT/gpu-tests.log 2>&1
    step tests $?
    for lm in mean mean_int8; do
      timeout 75 python3 -m sparrow.rollout_workers.native.bench decode-step --model qwen3-8b --batch 24 --contexts 16384 32768 --budget-tokens 5120 --replays 20 --landmark $lm --out $OUT/ds-8b-b24-$lm.json > $OUT/ds-8b-b24-$lm.log 2>&1
      step 8b-$lm $?
      timeout 60 python3 -m sparrow.rollout_workers.native.bench decode-step --model qwen3-4b --batch 24 --contexts 16384 32768 --budget-tokens 6144 --replays 20 --landmark $lm --out $OUT/ds-4b-b24-$lm.json > $OUT/ds-4b-b24-$lm.log 2>&1
      step 4b-$lm $?
    done
    tail -5 $OUT/gpu-tests.log
    for f in $OUT/ds-*.log; do echo "== $f"; grep -E "step|ms" $f | grep -v Warning | tail -12; done ;;
  sparse8b) timeout 585 benchmarks/rollout_protocol_gpu.sh qwen3-8b sparse 24 --overlap-decode --replayed 2 --landmark mean_int8; step sparse8b $? ;;
  sparse8bmean) timeout 585 benchmarks/rollout_protocol_gpu.sh qwen3-8b sparse 24 --overlap-decode --replayed 2; step sparse8bmean $? ;;
  dense1) END_STEP=22016 timeout 585 benchmarks/rollout_protocol_gpu.sh qwen3-8b dense 24 --overlap-decode --replayed 1; step dense1 $? ;;
  dense2) START_STEP=22016 timeout 585 benchmarks/rollout_protocol_gpu.sh qwen3-8b dense 24 --overlap-decode --replayed 1; step dense2 $? ;;
esac
