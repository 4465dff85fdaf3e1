#!/usr/bin/env bash
# Call 23 (2 x H200): the tensor-parallel all-reduce at decode sizes, NCCL vs symmetric-memory one-/two-shot.
set -uo pipefail
source benchmarks/gpu_env.sh
R=$OUT
{ nvidia-smi --query-gpu=index,name,driver_version --format=csv; nvidia-smi topo -m; } > $R/gpu.txt 2>&1
timeout 170 python3 benchmarks/allreduce_tp.py --out $R/allreduce-tp.json > $R/allreduce-tp.log 2>&1
echo "rc $?" >> $R/allreduce-tp.log
tail -25 $R/allreduce-tp.log
