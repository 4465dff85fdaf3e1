#!/usr/bin/env bash
# Call 18 (1 x H200): split-K partials for o/down summed in the add + RMSNorm. GPU tests; the projection sweep;
# decode steps (1.7B b8, 4B b24, 8B b16 at 32K) with partials (default tiling) and with cuBLAS (as before).
set -uo pipefail
source benchmarks/gpu_env.sh
R=$OUT; T0=$SECONDS; END=${END:-550}
left() { local l=$(( END - (SECONDS - T0) )); (( l > $1 )) && l=$1; echo $l; }
stage() { local cap=$1 name=$2; shift 2; local t=$(left $cap); (( t < 20 )) && { echo "skip $name" >> $R/progress.txt; return; }
  local s=$SECONDS; timeout $t "$@" > $R/$name.log 2>&1; echo "$name rc $? ${t}s-cap $((SECONDS-s))s" >> $R/progress.txt; }
{ nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > $R/gpu.txt
V=.gpurun/partials_variant.py
P17="decode-step --contexts 32768"
P4="decode-step --model qwen3-4b --batch 24 --contexts 32768 --budget-tokens 6144 --replays 20"
P8="decode-step --model qwen3-8b --batch 16 --contexts 32768 --budget-tokens 5120 --replays 20"
stage 90 gpu-tests-kernels python3 -m pytest tests/test_triton_kernels.py -m gpu -q -p no:cacheprovider -rfE
stage 100 residual-gemm python3 benchmarks/residual_gemm.py --out $R/residual-gemm.json
for v in default cublas; do
  stage 45 ds-1.7b-b8-$v python3 $V $v $P17 --out $R/ds-1.7b-b8-$v.json
  stage 45 ds-4b-b24-$v python3 $V $v $P4 --out $R/ds-4b-b24-$v.json
  stage 45 ds-8b-b16-$v python3 $V $v $P8 --out $R/ds-8b-b16-$v.json
done
stage 150 gpu-tests-engine python3 -m pytest tests/test_engine_cuda.py -m gpu -q -p no:cacheprovider -rfE
cat $R/progress.txt; tail -3 $R/gpu-tests-*.log; tail -12 $R/residual-gemm.log
for f in $R/ds-*.log; do echo "== $f"; grep -A5 "step ms" $f | head -8; grep -A9 "32768-sparse step goes" $f; done
tar czf /tmp/c18.tgz -C $R . && mv /tmp/c18.tgz $R/
