#!/usr/bin/env bash
# Call 14 (1 x H200): GPU tests at the adopted selection (early exit only, no fused merge); decode step records:
# 1.7B b8 (the Table 4 points), 4B b24 and 8B b16 at 32K with their 0.86 schedules' budgets.
set -uo pipefail
source benchmarks/gpu_env.sh
R=$OUT; T0=$SECONDS; END=${END:-540}
left() { local l=$(( END - (SECONDS - T0) )); (( l > $1 )) && l=$1; echo $l; }
stage() { local cap=$1 name=$2; shift 2; local t=$(left $cap); (( t < 20 )) && { echo "skip $name" >> $R/progress.txt; return; }
  local s=$SECONDS; timeout $t "$@" > $R/$name.log 2>&1; echo "$name rc $? ${t}s-cap $((SECONDS-s))s" >> $R/progress.txt; }
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > $R/gpu.txt
stage 60 decode-step-qwen3-1.7b-b8 python3 -m sparrow.rollout_workers.native.bench decode-step --out $R/decode-step-qwen3-1.7b-b8.json
stage 60 decode-step-qwen3-4b-b24 python3 -m sparrow.rollout_workers.native.bench decode-step --model qwen3-4b --batch 24 --contexts 32768 --budget-tokens 6144 --replays 20 --out $R/decode-step-qwen3-4b-b24.json
stage 70 decode-step-qwen3-8b-b16 python3 -m sparrow.rollout_workers.native.bench decode-step --model qwen3-8b --batch 16 --contexts 32768 --budget-tokens 5120 --replays 20 --out $R/decode-step-qwen3-8b-b16.json
stage 60 select-sweep python3 benchmarks/select_sweep.py $R/select-sweep.json
stage 240 gpu-tests python3 -m pytest tests/test_engine_cuda.py tests/test_triton_kernels.py -m gpu -q -p no:cacheprovider -rfE
cat $R/progress.txt; tail -3 $R/gpu-tests.log
for f in $R/decode-step-*.log; do echo "== $f"; grep -B2 -A12 "step ms" $f | head -30; grep -A12 "32768-sparse step goes" $f; done
