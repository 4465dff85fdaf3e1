#!/usr/bin/env bash
# Qwen3-1.7B, one H200, batch 8, the 32K protocol, overlapped decode, fused sampler, the loop timed whole
# (every engine step from the end of the one before): sparse, then dense, one call.
set -uo pipefail
source benchmarks/gpu_env.sh
T0=$(date +%s)
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" > $OUT/versions.txt
timeout 190 benchmarks/rollout_protocol_gpu.sh qwen3-1.7b sparse 8 --overlap-decode --replayed 1 --time-cap 160 > /dev/null 2>&1
echo "sparse rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/progress.txt
timeout 250 benchmarks/rollout_protocol_gpu.sh qwen3-1.7b dense 8 --overlap-decode --replayed 1 --time-cap 215 > /dev/null 2>&1
echo "dense rc $? at $(( $(date +%s) - T0 )) s" >> $OUT/progress.txt
cat $OUT/progress.txt; grep -A4 "mode  prefill" $OUT/*.log; grep -h -A4 "real ms" $OUT/*.log
python3 -c "
import json,glob
for f in sorted(glob.glob('$OUT/*.json')):
    for m,v in json.load(open(f))['modes'].items(): print(f, m, 'wall', round(v['wall_s'],1), 'decode', round(v['decode_seconds'],1), 'reads', v.get('decode_reads'))"
