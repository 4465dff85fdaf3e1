#!/usr/bin/env bash
# decode-step with the sparse layers' split count forced to 2 / 4 / the rule (8 at batch 24), 8B and 4B at batch 24.
set -uo pipefail
source benchmarks/gpu_env.sh
R=$OUT; T0=$SECONDS
for s in 0 4 2; do
  timeout 60 python3 variant.py $s decode-step --model qwen3-8b --batch 24 --contexts 16384 32768 --budget-tokens 5120 --replays 20 --out $R/8b-s$s.json > $R/8b-s$s.log 2>&1
  echo "8b s$s rc $? at $((SECONDS-T0)) s" >> $R/progress.txt
  timeout 60 python3 variant.py $s decode-step --model qwen3-4b --batch 24 --contexts 16384 32768 --budget-tokens 6144 --replays 20 --out $R/4b-s$s.json > $R/4b-s$s.log 2>&1
  echo "4b s$s rc $? at $((SECONDS-T0)) s" >> $R/progress.txt
done
cat $R/progress.txt
for f in $R/*.log; do echo "== $f"; grep -E "forced|step .* ms" $f | grep -v "unfused\|Warning" | head -8; done
rm -f $R/*.json
