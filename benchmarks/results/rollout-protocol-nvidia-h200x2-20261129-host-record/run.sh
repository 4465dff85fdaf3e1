#!/usr/bin/env bash
# Session 15 (2026-11-29): 8B 32K protocol with FP8 pages at batch 48 (one H200 holds it: 127.5 of 133.0 GB free),
# then the 4B bf16 pair at batch 24, both with the host record; segments run two at a time, one per GPU of an x2 lease.
set -uo pipefail
source benchmarks/gpu_env.sh
T0=$SECONDS
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" > $OUT/versions.txt
step() { echo "$1 rc $2 at $((SECONDS-T0)) s" | tee -a $OUT/progress-$CALL.txt; }
P=benchmarks/rollout_protocol_gpu.sh
F8="--overlap-decode --kv-cache-dtype fp8_e4m3 --replayed 1"
BF="--overlap-decode --replayed 1"
on() { local gpu=$1 label=$2; shift 2; (CUDA_VISIBLE_DEVICES=$gpu "$@" > /dev/null; step $label $?) & }
case $CALL in
  one)
    on 0 denseA env END_STEP=18432 timeout 575 $P qwen3-8b dense 48 $F8
    on 1 denseB env START_STEP=18432 END_STEP=26112 timeout 575 $P qwen3-8b dense 48 $F8
    wait ;;
  two)
    on 0 denseC env START_STEP=26112 timeout 575 $P qwen3-8b dense 48 $F8
    on 1 sparse8b env timeout 575 $P qwen3-8b sparse 48 $F8
    wait ;;
  three)
    (CUDA_VISIBLE_DEVICES=0; export CUDA_VISIBLE_DEVICES
     END_STEP=22016 timeout 330 $P qwen3-4b dense 24 $BF > /dev/null; step dense4bA $?
     END_STEP=16384 timeout 240 $P qwen3-4b sparse 24 $BF > /dev/null; step sparse4bA $?) &
    (CUDA_VISIBLE_DEVICES=1; export CUDA_VISIBLE_DEVICES
     START_STEP=22016 timeout 330 $P qwen3-4b dense 24 $BF > /dev/null; step dense4bB $?
     START_STEP=16384 timeout 240 $P qwen3-4b sparse 24 $BF > /dev/null; step sparse4bB $?) &
    wait ;;
esac
tail -n 5 $OUT/*.log
