#!/usr/bin/env bash
# Call 1 (1 x H200): GPU tests at HEAD + fused score/select; decode step two launches vs fused (8B b24, 1.7B b8).
set -uo pipefail
source benchmarks/gpu_env.sh
R=$OUT; T0=$SECONDS; END=${END:-560}
left() { local l=$(( END - (SECONDS - T0) )); (( l > $1 )) && l=$1; echo $l; }
stage() { local cap=$1 name=$2; shift 2; local t=$(left $cap); (( t < 20 )) && { echo "skip $name" >> $R/progress.txt; return; }
  local s=$SECONDS; timeout $t "$@" > $R/$name.log 2>&1; echo "$name rc $? ${t}s-cap $((SECONDS-s))s" >> $R/progress.txt; }
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" > $R/progress.txt
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv >> $R/progress.txt
stage 150 gpu-tests-kernels python3 -m pytest tests/test_triton_kernels.py -m gpu -q -p no:cacheprovider -rfE
for v in base fused; do
  stage 80 ds-8b-b24-$v python3 .gpurun/fsel_variant.py $v decode-step --model qwen3-8b --batch 24 --contexts 16384 32768 --budget-tokens 5120 --replays 20 --out $R/ds-8b-b24-$v.json
done
for v in base fused; do
  stage 60 ds-1.7b-b8-$v python3 .gpurun/fsel_variant.py $v decode-step --contexts 16384 32768 --replays 30 --out $R/ds-1.7b-b8-$v.json
done
stage 150 gpu-tests-engine python3 -m pytest tests/test_engine_cuda.py tests/test_engine_overlap.py -m gpu -q -p no:cacheprovider -rfE
cat $R/progress.txt; tail -3 $R/gpu-tests-kernels.log $R/gpu-tests-engine.log
for f in $R/ds-*.log; do echo "== $f"; grep -B2 -A14 "past KV" $f | head -40; done
mkdir -p $R/extra; mv $R/*.json $R/extra/ 2>/dev/null; tar czf /tmp/extra.tgz -C $R extra && rm -rf $R/extra && mv /tmp/extra.tgz $R/extra.tgz
