#!/usr/bin/env bash
# decode-step under PyTorch's default cuBLAS and under TORCH_BLAS_PREFER_CUBLASLT=1, three shapes, one process each.
set -uo pipefail
source benchmarks/gpu_env.sh
R=$OUT; T0=$SECONDS
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" > $R/progress.txt
run() {  # name blas args...
  local name=$1 blas=$2; shift 2
  if [ "$blas" = lt ]; then export TORCH_BLAS_PREFER_CUBLASLT=1; else unset TORCH_BLAS_PREFER_CUBLASLT; fi
  python3 -c "import torch; print('$name', torch.backends.cuda.preferred_blas_library())" >> $R/progress.txt
  timeout 120 python3 -m sparrow.rollout_workers.native.bench decode-step "$@" --out $R/$name.json > $R/$name.log 2>&1
  echo "$name rc $? at $((SECONDS-T0)) s" >> $R/progress.txt
}
for blas in default lt; do
  run 8b-b24-$blas $blas --model qwen3-8b --batch 24 --contexts 8192 32768 --budget-tokens 5120 --replays 20
  run 17b-b8-$blas $blas --model qwen3-1.7b --batch 8 --contexts 32768
  run 4b-b24-$blas $blas --model qwen3-4b --batch 24 --contexts 32768 --budget-tokens 6144 --replays 20
done
cat $R/progress.txt
for f in $R/*.log; do echo "== $f"; grep -E "step .* ms|unfused|fused" $f | grep -v Warning | head -12; done
