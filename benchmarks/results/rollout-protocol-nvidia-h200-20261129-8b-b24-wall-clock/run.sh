#!/usr/bin/env bash
# Qwen3-8B bf16, one H200, batch 24 (3 prompts x 8), the 32K protocol, overlapped decode, fused sampler (the
# default since 2026-11-28). Three nvidia-h200 calls on one machine kept warm between them (2026-11-29, session 12), each
# under the 10-minute limit: CALL=sparse, then CALL=dense1 (decode steps 0-22015), then CALL=dense2 (22016 on).
# Joined afterwards on the workstation:
#   sparrow bench rollout-merge rollout-qwen3-8b-b24-sparse.json rollout-qwen3-8b-b24-dense-to22016.json \
#     rollout-qwen3-8b-b24-dense-from22016.json --out rollout-qwen3-8b-b24.json
set -uo pipefail
source benchmarks/gpu_env.sh
T0=$(date +%s)
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" > $OUT/versions.txt
case $CALL in
  sparse) timeout 585 benchmarks/rollout_protocol_gpu.sh qwen3-8b sparse 24 --overlap-decode --replayed 1 ;;
  dense1) END_STEP=22016 timeout 585 benchmarks/rollout_protocol_gpu.sh qwen3-8b dense 24 --overlap-decode --replayed 1 ;;
  dense2) START_STEP=22016 timeout 585 benchmarks/rollout_protocol_gpu.sh qwen3-8b dense 24 --overlap-decode --replayed 1 ;;
esac
echo "$CALL rc $? at $(( $(date +%s) - T0 )) s" | tee $OUT/progress-$CALL.txt
