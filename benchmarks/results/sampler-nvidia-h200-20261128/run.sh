# Call 1 (the first version: torch.topk for the logprob list, a bench that timed launches), then its fix:
#   .gpurun/call-sampler.sh as below but before the in-kernel top-k; files in first-version/.
# Call 2 (a Triton compile error: a plain global in a kernel), call 3 (this folder):
# The fused sampler with its in-kernel top-k, one H200: the sampler alone (GPU time, eager vs fused), GPU tests,
# the decode step (1.7B batch 8; 8B batch 24) with the sampler after it.
set -uo pipefail
source benchmarks/gpu_env.sh
T0=$(date +%s); R=$OUT; P=$R/progress.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" > $R/versions.txt
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv >> $R/versions.txt
timeout 90 python3 benchmarks/sampler_bench.py > $R/sampler.json 2> $R/sampler.log
echo "sampler bench rc $? at $(( $(date +%s) - T0 )) s" >> $P; cat $R/sampler.log
( timeout 60 python3 -m pytest -q -m gpu tests/test_triton_kernels.py -k sampler
  timeout 200 python3 -m pytest -q -m gpu tests/test_engine_cuda.py tests/test_engine_overlap.py ) > $R/gpu-tests.log 2>&1
echo "gpu tests rc $? at $(( $(date +%s) - T0 )) s" >> $P; grep -E "passed|failed|error" $R/gpu-tests.log
mkdir -p $R/ds
timeout 80 python3 -m sparrow.rollout_workers.native.bench decode-step --contexts 32768 --out $R/ds/decode-step-qwen3-1.7b-b8.json > $R/ds/decode-step-qwen3-1.7b-b8.log 2>&1
echo "decode-step 1.7B rc $? at $(( $(date +%s) - T0 )) s" >> $P; grep "past KV" $R/ds/decode-step-qwen3-1.7b-b8.log | head -3
timeout 120 python3 -m sparrow.rollout_workers.native.bench decode-step --model qwen3-8b --batch 24 --contexts 32768 --budget-tokens 5120 --replays 20 --out $R/ds/decode-step-qwen3-8b-b24.json > $R/ds/decode-step-qwen3-8b-b24.log 2>&1
echo "decode-step 8B b24 rc $? at $(( $(date +%s) - T0 )) s" >> $P; grep "past KV\|unfused" $R/ds/decode-step-qwen3-8b-b24.log | head -6
cat $P
tar czf /tmp/ds.tgz -C $R ds && rm -rf $R/ds && mv /tmp/ds.tgz $R/ds.tgz
# Call 4: the real run, Qwen3-1.7B batch 8, sparse, decode steps 0-8191: fused, eager, fused again (one process each)
source benchmarks/gpu_env.sh; B="python3 -m sparrow.rollout_workers.native.bench rollout --model qwen3-1.7b --device cuda --prompt-len 256 --gen-len 32768 --samples 8 --batch 8 --schedule qwen3-1.7b-0.86 --overlap-decode --mode sparse --end-step 8192"; T0=$(date +%s); for s in fused eager fused2; do timeout 70 $B $([ $s = eager ] && echo --eager-sampler) --out $OUT/ab-1.7b-b8-sparse-$s.json > $OUT/ab-1.7b-b8-sparse-$s.log 2>&1; echo "$s rc $? at $(( $(date +%s) - T0 )) s"; grep -A2 "mode  prefill" $OUT/ab-1.7b-b8-sparse-$s.log | tail -1; done
