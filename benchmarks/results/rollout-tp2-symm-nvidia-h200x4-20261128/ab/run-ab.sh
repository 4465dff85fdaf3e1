#!/usr/bin/env bash
# Call 25 (4 x H200): the symmetric-memory all-reduce of the tensor-parallel engine.
# GPUs 0,1: the 2-GPU parity tests (eager, CUDA graphs, CUDA graphs with NCCL only), then Qwen3-8B bf16 TP2 batch 40
# DENSE decode steps 24576-26623 with symmetric memory, then the same with --nccl-all-reduce.
# GPUs 2,3: the same segment SPARSE (qwen3-8b-0.86), symmetric memory then NCCL.
set -uo pipefail
source benchmarks/gpu_env.sh
T0=$(date +%s); R=$OUT
nvidia-smi --query-gpu=index,name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > $R/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $R/gpu.txt
B="python3 -m sparrow.rollout_workers.native.bench rollout --model qwen3-8b --device cuda --tensor-parallel 2 --prompt-len 256 --gen-len 32768 --samples 8 --batch 40 --schedule qwen3-8b-0.86 --overlap-decode --start-step 24576 --end-step 26624"
N=ab-tp2-qwen3-8b-b40
( CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m pytest tests/test_engine_tensor_parallel.py -m gpu -q -p no:cacheprovider -rfE > $R/tp-test.log 2>&1
  echo "tp-test rc $? at $(( $(date +%s) - T0 )) s" >> $R/progress.txt
  CUDA_VISIBLE_DEVICES=0,1 timeout 190 $B --mode dense --out $R/$N-dense-symm.json > $R/$N-dense-symm.log 2>&1
  echo "dense symm rc $? at $(( $(date +%s) - T0 )) s" >> $R/progress.txt
  CUDA_VISIBLE_DEVICES=0,1 timeout 190 $B --mode dense --nccl-all-reduce --out $R/$N-dense-nccl.json > $R/$N-dense-nccl.log 2>&1
  echo "dense nccl rc $? at $(( $(date +%s) - T0 )) s" >> $R/progress.txt ) &
( sleep 3; CUDA_VISIBLE_DEVICES=2,3 timeout 200 $B --mode sparse --out $R/$N-sparse-symm.json > $R/$N-sparse-symm.log 2>&1
  echo "sparse symm rc $? at $(( $(date +%s) - T0 )) s" >> $R/progress.txt
  CUDA_VISIBLE_DEVICES=2,3 timeout 200 $B --mode sparse --nccl-all-reduce --out $R/$N-sparse-nccl.json > $R/$N-sparse-nccl.log 2>&1
  echo "sparse nccl rc $? at $(( $(date +%s) - T0 )) s" >> $R/progress.txt ) &
wait
cat $R/progress.txt
tail -5 $R/tp-test.log
for f in $R/$N-*.log; do echo "== $f"; grep -v "decode steps" $f | grep -v "^  File\|Current thread\|^\"" | tail -6; done
tar czf /tmp/c25.tgz -C $R . && mv /tmp/c25.tgz $R/
