#!/usr/bin/env bash
# Session 16 (2026-11-29): the 4B 32K protocol with FP8 pages at batch 48 (the largest batch of 8-sample groups one
# H200 holds), with the host record; one nvidia-h200 lease, one segment per call: dense 0 / 18432 / 26112, sparse whole.
set -uo pipefail
source benchmarks/gpu_env.sh
T0=$SECONDS
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" > $OUT/versions.txt
step() { echo "$1 rc $2 at $((SECONDS-T0)) s" | tee -a $OUT/progress-$CALL.txt; }
P=benchmarks/rollout_protocol_gpu.sh
F8="--overlap-decode --kv-cache-dtype fp8_e4m3 --replayed 1"
case $CALL in
  denseA) env END_STEP=18432 timeout 575 $P qwen3-4b dense 48 $F8 > /dev/null; step $CALL $? ;;
  denseB) env START_STEP=18432 END_STEP=26112 timeout 575 $P qwen3-4b dense 48 $F8 > /dev/null; step $CALL $? ;;
  denseC) env START_STEP=26112 timeout 575 $P qwen3-4b dense 48 $F8 > /dev/null; step $CALL $? ;;
  sparse) timeout 575 $P qwen3-4b sparse 48 $F8 > /dev/null; step $CALL $? ;;
esac
tail -n 6 $OUT/*.log
