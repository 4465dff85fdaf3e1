#!/usr/bin/env bash
# The vLLM backend's GPU tests on a lent GPU machine, in one command: bash benchmarks/vllm_gpu.sh [pytest args]
#
# Needs the wheels benchmarks/vllm_stage.py staged and assembled under /tmp/staged (its printed calls end with this
# script). Installs them once into /tmp/vllm-site, makes Sparrow's vLLM plugin entry point visible there (the
# checkout is not pip-installed on that machine: gpu_env.sh links its folders into the sparrow package), runs
# `pytest -m gpu tests/test_vllm_gpu.py` and writes to $OUT: vllm-gpu.txt (machine, versions), vllm-gpu-tests.log,
# vllm-gpu-junit.xml and vllm-gpu-measured.json (the parity numbers, written as each is measured). TESTS_S caps the tests (default 480 s).
set -uo pipefail
source "$(dirname "$0")/vllm_env.sh" || exit 1
OUT=${OUT:-/tmp/sparrow-vllm}
export OUT
mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  git log -1 --format='commit %H' 2>/dev/null
  python3 - <<'PY'
import importlib.metadata as md
import torch, triton, vllm
from vllm import LLM  # noqa: F401  (the offline front end imports, as AsyncLLM does below)
from vllm.v1.engine.async_llm import AsyncLLM  # noqa: F401
from sparrow.rollout_workers.vllm_backend import _vllm
print("torch", torch.__version__, "triton", triton.__version__, "vllm", vllm.__version__)
print("surface", _vllm.surface())
print("plugins", [e.value for e in md.entry_points(group="vllm.general_plugins")])
PY
} 2>&1 | tee "$OUT/vllm-gpu.txt"
# SIGINT at the cap: pytest stops and still prints the failures so far (a plain kill left only "F" in the log).
timeout -s INT -k 30 "${TESTS_S:-480}" python3 -m pytest -m gpu tests/test_vllm_gpu.py -q -rfEs -p no:cacheprovider --durations=0 \
  --junitxml="$OUT/vllm-gpu-junit.xml" "$@" 2>&1 | tee "$OUT/vllm-gpu-tests.log"
