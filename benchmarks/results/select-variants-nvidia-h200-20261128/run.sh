#!/usr/bin/env bash
# Call 13 (1 x H200): new-variant GPU tests, selection sweep (early exit), decode step base vs fused merge + early exit.
set -uo pipefail
source benchmarks/gpu_env.sh
R=$OUT; T0=$SECONDS; END=${END:-555}
left() { local l=$(( END - (SECONDS - T0) )); (( l > $1 )) && l=$1; echo $l; }
stage() { local cap=$1 name=$2; shift 2; local t=$(left $cap); (( t < 20 )) && { echo "skip $name" >> $R/progress.txt; return; }
  local s=$SECONDS; timeout $t "$@" > $R/$name.log 2>&1; echo "$name rc $? ${t}s-cap $((SECONDS-s))s" >> $R/progress.txt; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $R/gpu.txt
stage 130 tests-new python3 -m pytest tests/test_triton_kernels.py -m gpu -q -p no:cacheprovider -rfE -k "fused_merge or selection_matches"
stage 110 select-sweep python3 benchmarks/select_sweep.py $R/select-sweep.json
for v in base both; do
  stage 75 ds-1.7b-$v python3 variant.py $v decode-step --contexts 32768 --replays 30 --out $R/ds-1.7b-$v.json
done
for v in base both; do
  stage 95 ds-4b-$v python3 variant.py $v decode-step --model qwen3-4b --batch 24 --contexts 32768 --budget-tokens 6144 --replays 20 --out $R/ds-4b-$v.json
done
cat $R/progress.txt; tail -3 $R/tests-new.log; tail -25 $R/select-sweep.log
for f in $R/ds-*.log; do echo "== $f"; grep -A40 "where the" $f | head -60; done
