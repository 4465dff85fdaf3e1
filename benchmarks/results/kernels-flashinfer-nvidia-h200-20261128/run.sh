#!/usr/bin/env bash
# Call 16 (1 x H200, after a call that copied .fi-a to /tmp/fi-a): FlashInfer beside Sparrow's decode kernels.
set -uo pipefail
source benchmarks/gpu_env.sh
R=$OUT; T0=$SECONDS; END=${END:-560}
left() { local l=$(( END - (SECONDS - T0) )); (( l > $1 )) && l=$1; echo $l; }
stage() { local cap=$1 name=$2; shift 2; local t=$(left $cap); (( t < 20 )) && { echo "skip $name" >> $R/progress.txt; return; }
  local s=$SECONDS; timeout $t "$@" > $R/$name.log 2>&1; echo "$name rc $? ${t}s-cap $((SECONDS-s))s" >> $R/progress.txt; }
bash .fi-b/install.sh <site-fi> > $R/install.log 2>&1; echo "install rc $? $((SECONDS-T0))s" >> $R/progress.txt
export PYTHONPATH=<site-fi>:$PYTHONPATH
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton, flashinfer; print('torch', torch.__version__, 'triton', triton.__version__, 'flashinfer', flashinfer.__version__)" > $R/versions.txt 2>&1
stage 170 tests python3 -m pytest tests/test_triton_kernels.py tests/test_flashinfer_baseline.py -m gpu -q -p no:cacheprovider -rfE
stage 520 bench python3 -m sparrow.kernels.bench_cli --no-sweep --out $R/kernels.json
cat $R/progress.txt $R/versions.txt; tail -3 $R/tests.log; grep -i "error\|Traceback" $R/bench.log | head -5; tail -45 $R/bench.log | cut -c1-220
