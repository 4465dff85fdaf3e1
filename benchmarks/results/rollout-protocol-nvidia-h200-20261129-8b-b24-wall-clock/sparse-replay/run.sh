#!/usr/bin/env bash
# Real vs replayed decode step for SPARSE at contexts the schedule makes sparse (22.5K-23K): two 1024-step segments,
# the 8B shape at batch 24 (the largest one H200 holds) and the 1.7B shape at batch 8.
set -uo pipefail
source benchmarks/gpu_env.sh
T0=$(date +%s)
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" > $OUT/versions.txt
START_STEP=22016 END_STEP=23040 timeout 280 benchmarks/rollout_protocol_gpu.sh qwen3-8b sparse 24 --overlap-decode --replayed 2 > /dev/null
echo "8b rc $? at $(( $(date +%s) - T0 )) s" | tee -a $OUT/progress.txt
START_STEP=22016 END_STEP=23040 timeout 200 benchmarks/rollout_protocol_gpu.sh qwen3-1.7b sparse 8 --overlap-decode --replayed 2 > /dev/null
echo "1.7b rc $? at $(( $(date +%s) - T0 )) s" | tee -a $OUT/progress.txt
for f in $OUT/*.log; do echo "== $f"; grep -v "decode steps" $f | grep -v Warning | tail -8; done
