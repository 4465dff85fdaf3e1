#!/usr/bin/env bash
# Session 17 (2026-11-29): where the 4B step goes at FP8 pages, batch 48 (the protocol's batch), bf16 vs int8 landmarks;
# then (CALL=diag) the attention kernel alone, HEAD against the working tree (attn_diag.py), the GPU kernel tests and the
# 4B step again. Calls 3-5 were given to the GPU machine as these commands (not through this script's cases):
#   source benchmarks/gpu_env.sh; timeout 575 benchmarks/rollout_protocol_gpu.sh qwen3-4b sparse 48 --overlap-decode --kv-cache-dtype fp8_e4m3 --replayed 1 > /dev/null
#   source benchmarks/gpu_env.sh; timeout 580 benchmarks/rollout_protocol_gpu.sh qwen3-8b sparse 48 --overlap-decode --kv-cache-dtype fp8_e4m3 --replayed 1 > /dev/null
#   source benchmarks/gpu_env.sh; timeout 560 benchmarks/rollout_protocol_gpu.sh qwen3-4b sparse 48 --overlap-decode --kv-cache-dtype fp8_e4m3 --replayed 1 --landmark mean_int8 > /dev/null
# (the sparseint8 case below was not used). attn_diag.py ran from .gpurun/; it is in diag/.
set -uo pipefail
source benchmarks/gpu_env.sh
T0=$SECONDS
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" > $OUT/versions.txt
step() { echo "$1 rc $2 at $((SECONDS-T0)) s" | tee -a $OUT/progress-$CALL.txt; }
P=benchmarks/rollout_protocol_gpu.sh
F8="--overlap-decode --kv-cache-dtype fp8_e4m3 --replayed 1"
case $CALL in
  step)
    for lm in mean mean_int8; do
      timeout 270 python3 -m sparrow.rollout_workers.native.bench decode-step --model qwen3-4b --batch 48 --contexts 16384 32768 \
        --budget-tokens 6144 --replays 20 --kv-cache-dtype fp8_e4m3 --landmark $lm --out $OUT/ds-4b-b48-fp8-$lm.json > $OUT/ds-4b-b48-fp8-$lm.log 2>&1
      step $lm $?
    done
    for f in $OUT/ds-*.log; do echo "== $f"; grep -v Warning $f | tail -60; done ;;
  sparseint8) timeout 575 $P qwen3-4b sparse 48 $F8 --landmark mean_int8 > /dev/null; step $CALL $?; tail -n 8 $OUT/*.log ;;
esac
case $CALL in
  diag)
    git show HEAD:kernels/triton/attention.py > kernels/triton/_attention_old.py
    timeout 240 python3 .gpurun/attn_diag.py $OUT/attn-diag.json > $OUT/attn-diag.log 2>&1; step diag $?
    timeout 150 python3 -m pytest tests/test_triton_kernels.py -m gpu -q -p no:cacheprovider -rfE > $OUT/gpu-tests-kernels.log 2>&1; step tests $?
    timeout 130 python3 -m sparrow.rollout_workers.native.bench decode-step --model qwen3-4b --batch 48 --contexts 16384 32768 \
        --budget-tokens 6144 --replays 20 --kv-cache-dtype fp8_e4m3 --out $OUT/ds-4b-b48-fp8-tree.json > $OUT/ds-4b-b48-fp8-tree.log 2>&1
    step ds $?
    cat $OUT/attn-diag.log | grep -v Warn; tail -3 $OUT/gpu-tests-kernels.log; grep -v Warn $OUT/ds-4b-b48-fp8-tree.log | tail -40 ;;
esac
