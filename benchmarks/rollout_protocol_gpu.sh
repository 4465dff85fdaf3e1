#!/usr/bin/env bash
# The paper's rollout protocol measured end to end on one GPU, one mode per call (each fits a 10-minute job):
#   benchmarks/rollout_protocol_gpu.sh MODEL MODE BATCH [extra `bench rollout` options]
# MODEL a shape (qwen3-1.7b, qwen3-4b, qwen3-8b; random bf16 weights), MODE dense|sparse, BATCH a number or auto.
# 256-token prompts, 32,768 generated tokens, 8 samples per prompt, the model's 0.86 schedule; the real decode
# step is compared with the graph-replayed one at 6 contexts. JSON + log go to $OUT; merge the two modes with
#   sparrow bench rollout-merge OUT/rollout-MODEL-bB-dense.json OUT/rollout-MODEL-bB-sparse.json
# A mode longer than one job runs in segments: START_STEP=N (a multiple of 512) measures it from decode step N on,
# END_STEP=M stops it after step M - 1, into rollout-MODEL-bB-MODE-fromN[-toM].*; give rollout-merge every segment's file.
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
model=$1 mode=$2 batch=$3; shift 3
start=${START_STEP:-0} end=${END_STEP:-}
name="rollout-$model-b$batch-$mode$([ "$start" -gt 0 ] && echo "-from$start")${end:+-to$end}"
OUT=${OUT:-/tmp/sparrow-rollout}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -m sparrow.bench.rollout rollout --model "$model" --device cuda --prompt-len 256 \
  --gen-len 32768 --samples 8 --batch "$batch" --schedule "$model-0.86" --mode "$mode" --replayed 6 \
  --start-step "$start" ${end:+--end-step "$end"} --out "$OUT/$name.json" "$@" 2>&1 | tee "$OUT/$name.log"
