#!/usr/bin/env bash
# The two-GPU runs of issue 16, one stage per call (each fits a 10-minute GPU job); logs and JSON go to $OUT.
#   benchmarks/two_gpu.sh tp-test                   the tensor-parallel parity tests on two GPUs (NCCL; eager and CUDA graphs)
#   benchmarks/two_gpu.sh tp-rollout MODEL MODE B   the paper's 32K protocol, the engine split over both GPUs
#                                                   (MODE dense|sparse; merge the two with `bench rollout-merge`)
#   benchmarks/two_gpu.sh publish MODEL [N]         weight publication, GPU 0 -> N engines on GPUs 1..N (default 1)
#   benchmarks/two_gpu.sh train [STEPS]             sparrow train, deploy/configs/smollm2-longctx-2gpu.yaml (rollout
#                                                   worker on one GPU, trainer on the other, NCCL publication), SmolLM2
#                                                   staged at /tmp/smollm2 (../shared/tools/stage-smollm2.sh); with
#                                                   KILL_AFTER_S=S the rollout worker's process is killed once, S s into
#                                                   the run (the job replaces it and goes on; the report counts it)
# MODEL is a shape (qwen3-1.7b, qwen3-4b, qwen3-8b; random bf16 weights). Extra options go to the bench (to
# sparrow train for `train`). Seen on H200s (2026-11-27): publish 40-60 s per shape to one engine (the 8B's three
# versions need more than 90 s); train ~40 s per step after a ~70 s first step; tp-rollout qwen3-8b 8 decodes 32K
# tokens in 236 s dense, 196 s sparse, after ~50 s of start-up, then its ranks hang in their process exit and the
# bench kills them 15 s after writing the report: give the call at least 360 s (dense); tp-test takes ~120 s.
# With 4 GPUs, run two stages at once on disjoint pairs (CUDA_VISIBLE_DEVICES=0,1 and 2,3, separate OUT).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
OUT=${OUT:-/tmp/sparrow-two-gpu}; mkdir -p "$OUT"
stage=$1; shift
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
nvidia-smi topo -m >> "$OUT/gpu.txt" 2>&1
case $stage in
  tp-test)
    python3 -m pytest tests/test_engine_tensor_parallel.py -m gpu -q -p no:cacheprovider -rfE 2>&1 | tee "$OUT/tp-test.log" ;;
  tp-rollout)
    model=$1 mode=$2 batch=$3; shift 3
    python3 -m sparrow.bench.rollout rollout --model "$model" --device cuda --tensor-parallel 2 \
      --prompt-len 256 --gen-len 32768 --samples 8 --batch "$batch" --schedule "$model-0.86" --mode "$mode" \
      --out "$OUT/rollout-tp2-$model-b$batch-$mode.json" "$@" 2>&1 | tee "$OUT/rollout-tp2-$model-b$batch-$mode.log" ;;
  publish)
    model=$1 receivers=${2:-1}; shift $(( $# < 2 ? $# : 2 ))
    python3 -m sparrow.cli.main bench publish --model "$model" --device cuda --receivers "$receivers" \
      --out "$OUT/publish-$model-r$receivers.json" "$@" 2>&1 | tee "$OUT/publish-$model-r$receivers.log" ;;
  train)
    steps=${1:-6}; shift $(( $# < 1 ? $# : 1 ))
    if [ "${KILL_AFTER_S:-0}" -gt 0 ]; then
      ( sleep "$KILL_AFTER_S"; pkill -9 -f 'ray::RolloutWorker' && echo "fault: killed the rollout worker at $KILL_AFTER_S s" ) &
    fi
    runs=/tmp/sparrow-two-gpu-runs; rm -rf "$runs"
    python3 -m sparrow.cli.main train --config deploy/configs/smollm2-longctx-2gpu.yaml --set model=/tmp/smollm2 \
      --set run.steps="$steps" --set run.out_dir="$runs" "$@" 2>&1 | tee "$OUT/train.log"
    run_dir=$(ls -d "$runs"/*/ | head -1)  # the small files only: checkpoints (GBs) stay behind
    cp "$run_dir"/{config.yaml,metrics.jsonl,events.jsonl,controller_decisions.jsonl} "$OUT"/ 2>/dev/null
    tar czf "$OUT/report.tgz" -C "$run_dir" report ;;
  *) echo "stage $stage: use tp-test, tp-rollout, publish or train" >&2; exit 2 ;;
esac
