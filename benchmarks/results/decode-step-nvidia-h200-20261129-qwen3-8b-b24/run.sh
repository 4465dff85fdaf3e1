#!/usr/bin/env bash
# GPU tests at the final tree + decode-step 8B b24 32K with its fusion ablation (the float32-at-load fix).
set -uo pipefail
source benchmarks/gpu_env.sh
R=$OUT; T0=$SECONDS
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" > $R/progress.txt
timeout 150 python3 -m pytest tests/test_triton_kernels.py -m gpu -q -p no:cacheprovider -rfE > $R/gpu-tests-kernels.log 2>&1
echo "kernels rc $? at $((SECONDS-T0)) s" >> $R/progress.txt
timeout 150 python3 -m pytest tests/test_engine_cuda.py tests/test_engine_overlap.py -m gpu -q -p no:cacheprovider -rfE > $R/gpu-tests-engine.log 2>&1
echo "engine rc $? at $((SECONDS-T0)) s" >> $R/progress.txt
timeout 150 python3 -m sparrow.rollout_workers.native.bench decode-step --model qwen3-8b --batch 24 --contexts 32768 --budget-tokens 5120 --replays 20 --out $R/decode-step-qwen3-8b-b24.json > $R/decode-step-qwen3-8b-b24.log 2>&1
echo "decode-step 8B b24 rc $? at $((SECONDS-T0)) s" >> $R/progress.txt
cat $R/progress.txt; tail -n 2 $R/gpu-tests-*.log; grep -v Warning $R/decode-step-qwen3-8b-b24.log | tail -30
