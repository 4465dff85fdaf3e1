#!/usr/bin/env bash
# Several arms of the stability study at once on one GPU machine (docs/stability.md): each arm is its own
# `sparrow train` job (its own local Ray, free transport ports, its own metrics port) sharing the GPU, so the
# arms of one 10-minute GPU call see the same contention. Same options for every arm; logs in $LOG_DIR.
# On a machine with several GPUs, GPUS="0 1 2 3" gives the i-th arm GPU i (CUDA_VISIBLE_DEVICES), so each arm
# runs alone on its GPU. An arm may be written ARM:LABEL to run it under another label (see --label).
# Usage (repo root): [GPUS="0 1 2"] LOG_DIR=$OUT benchmarks/stability_gpu_arms.sh "a b c" --config CFG --steps 8 --out-dir $OUT ...
set -uo pipefail
arms=${1:?'first argument: the arms to run, e.g. "a b c"'}
shift
log_dir=${LOG_DIR:-.}
mkdir -p "$log_dir"
read -r -a gpus <<< "${GPUS:-}"
port=${METRICS_PORT:-9400}  # two calls of this script at once: give the second another METRICS_PORT
pids=()
labels=()
i=0
for spec in $arms; do
  arm=${spec%%:*} label=${spec#*:}
  if [ ${#gpus[@]} -gt 0 ]; then
    [ "$i" -lt ${#gpus[@]} ] || { echo "GPUS=\"${GPUS}\": ${#gpus[@]} GPUs for more arms ($arms); name one GPU per arm" >&2; exit 2; }
    export CUDA_VISIBLE_DEVICES=${gpus[$i]}
  fi
  "$(dirname "$0")/stability_gpu.sh" --arm "$arm" --label "$label" "$@" --set "metrics.port=$port" \
    > "$log_dir/arm-$label.log" 2>&1 &
  pids+=($!)
  labels+=("$label")
  echo "arm $label: pid $! metrics port $port GPU ${CUDA_VISIBLE_DEVICES:-shared} log $log_dir/arm-$label.log"
  i=$((i + 1))
  port=$((port + 100))
  sleep 2
done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done
for label in "${labels[@]}"; do echo "== arm $label"; grep -E "^step |^arm " "$log_dir/arm-$label.log" | tail -n 30; done
exit "$rc"
