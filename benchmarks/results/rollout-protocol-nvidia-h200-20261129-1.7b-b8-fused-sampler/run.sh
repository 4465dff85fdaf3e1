#!/usr/bin/env bash
# Qwen3-1.7B, one H200, batch 8, the 32K protocol, overlapped decode, fused sampler: sparse, then dense, one call.
set -uo pipefail
T0=$(date +%s)
timeout 160 benchmarks/rollout_protocol_gpu.sh qwen3-1.7b sparse 8 --overlap-decode --replayed 1 --time-cap 135 > /dev/null 2>&1
echo "sparse rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/progress.txt
timeout 215 benchmarks/rollout_protocol_gpu.sh qwen3-1.7b dense 8 --overlap-decode --replayed 1 --time-cap 185 > /dev/null 2>&1
echo "dense rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/progress.txt
cat $OUT/progress.txt; grep -A4 "mode  prefill" $OUT/*.log
