#!/usr/bin/env bash
# Qwen3-4B bf16, tensor-parallel 2 (decode all-reduces through symmetric memory, the default), batch 40, 32K protocol,
# overlapped decode, SPARSE in two segments at once: GPUs 0,1 decode steps 0-21503, GPUs 2,3 steps 21504-32767.
set -uo pipefail
source benchmarks/gpu_env.sh
T0=$(date +%s); R=$OUT
nvidia-smi --query-gpu=index,name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv > $R/gpu-4b-sparse.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" >> $R/gpu-4b-sparse.txt
B="python3 -m sparrow.rollout_workers.native.bench rollout --model qwen3-4b --device cuda --tensor-parallel 2 --prompt-len 256 --gen-len 32768 --samples 8 --batch 40 --schedule qwen3-4b-0.86 --overlap-decode"
N=rollout-tp2-qwen3-4b-b40
( CUDA_VISIBLE_DEVICES=0,1 timeout 570 $B --mode sparse --end-step 21504 --out $R/$N-sparse-to21504.json > $R/$N-sparse-to21504.log 2>&1
  echo "sparse 0-21503 rc $? at $(( $(date +%s) - T0 )) s" >> $R/progress-4b-sparse.txt ) &
( sleep 3; CUDA_VISIBLE_DEVICES=2,3 timeout 567 $B --mode sparse --start-step 21504 --out $R/$N-sparse-from21504.json > $R/$N-sparse-from21504.log 2>&1
  echo "sparse 21504-32767 rc $? at $(( $(date +%s) - T0 )) s" >> $R/progress-4b-sparse.txt ) &
wait
cat $R/progress-4b-sparse.txt
for f in $R/*.log; do echo "== $f"; grep -v "decode steps" $f | grep -v "^  File\|Current thread\|^\"" | tail -6; done
tar czf /tmp/c.tgz -C $R . && mv /tmp/c.tgz $R/4b-sparse-extra.tgz
