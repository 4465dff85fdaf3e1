#!/usr/bin/env bash
# Several arms of the stability study at once on one GPU machine (docs/stability.md): each arm is its own
# `sparrow train` job (its own local Ray, free transport ports, its own metrics port) sharing the GPU, so the
# arms of one 10-minute GPU call see the same contention. Same options for every arm; logs in $LOG_DIR.
# Usage (repo root): LOG_DIR=$OUT benchmarks/stability_gpu_arms.sh "a b c" --config CFG --steps 8 --out-dir $OUT ...
set -uo pipefail
arms=${1:?'first argument: the arms to run, e.g. "a b c"'}
shift
log_dir=${LOG_DIR:-.}
mkdir -p "$log_dir"
port=9400
pids=()
for arm in $arms; do
  "$(dirname "$0")/stability_gpu.sh" --arm "$arm" "$@" --set "metrics.port=$port" > "$log_dir/arm-$arm.log" 2>&1 &
  pids+=($!)
  echo "arm $arm: pid $! metrics port $port log $log_dir/arm-$arm.log"
  port=$((port + 100))
  sleep 2
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
for arm in $arms; do echo "== arm $arm"; grep -E "^step |^arm " "$log_dir/arm-$arm.log" | tail -n 30; done
exit "$rc"
