# The three nvidia-h200 calls, in order (one H200, the machine kept warm between them); $OUT is the call's output folder.
# ---- call-8b-b24-sparse.sh
# Qwen3-8B bf16, one H200, batch 24 (3 prompts x 8), 32K protocol, overlapped decode: SPARSE, the whole run.
set -uo pipefail
T0=$(date +%s)
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" > $OUT/versions.txt
timeout 585 benchmarks/rollout_protocol_gpu.sh qwen3-8b sparse 24 --overlap-decode --replayed 1
echo "sparse rc $? at $(( $(date +%s) - T0 )) s" | tee $OUT/progress-sparse.txt
grep -v "decode steps" $OUT/*.log | tail -20
# ---- call-8b-b24-dense1.sh
# Qwen3-8B bf16, one H200, batch 24, 32K protocol, overlapped decode: DENSE decode steps 0-22015.
set -uo pipefail
T0=$(date +%s)
END_STEP=22016 timeout 585 benchmarks/rollout_protocol_gpu.sh qwen3-8b dense 24 --overlap-decode --replayed 1
echo "dense 0-22015 rc $? at $(( $(date +%s) - T0 )) s" | tee $OUT/progress-dense1.txt
grep -v "decode steps" $OUT/*.log | tail -20
# ---- call-8b-b24-dense2.sh
# Qwen3-8B bf16, one H200, batch 24, 32K protocol, overlapped decode: DENSE decode steps 22016-32767.
set -uo pipefail
T0=$(date +%s)
START_STEP=22016 timeout 585 benchmarks/rollout_protocol_gpu.sh qwen3-8b dense 24 --overlap-decode --replayed 1
echo "dense 22016-32767 rc $? at $(( $(date +%s) - T0 )) s" | tee $OUT/progress-dense2.txt
grep -v "decode steps" $OUT/*.log | tail -20
# ---- the fourth call (decode-step; crashed at its fusion ablation, fixed in the commit that adds this folder)
source benchmarks/gpu_env.sh && python3 -m sparrow.rollout_workers.native.bench decode-step --model qwen3-8b --batch 24 --contexts 32768 --budget-tokens 5120 --replays 20 --out $OUT/decode-step-qwen3-8b-b24.json 2>&1 | tee $OUT/decode-step-qwen3-8b-b24.log
