#!/usr/bin/env bash
# The vLLM backend's GPU tests on a lent GPU machine, in one command: bash benchmarks/vllm_gpu.sh [pytest args]
#
# Needs the wheels benchmarks/vllm_stage.py staged and assembled under /tmp/staged (its printed calls end with this
# script). Installs them once into /tmp/vllm-site, makes Sparrow's vLLM plugin entry point visible there (the
# checkout is not pip-installed on that machine: gpu_env.sh links its folders into the sparrow package), runs
# `pytest -m gpu tests/test_vllm_gpu.py` and writes to $OUT: vllm-gpu.txt (machine, versions), vllm-gpu-tests.log,
# vllm-gpu-junit.xml and vllm-gpu-measured.json (the parity numbers). TESTS_S caps the tests (default 480 s).
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
OUT=${OUT:-/tmp/sparrow-vllm}
export OUT
mkdir -p "$OUT"
SITE=/tmp/vllm-site
if [ ! -e "$SITE/.sparrow-vllm" ]; then
  wheels=(/tmp/staged/.vllm-wheels/*.whl)
  [ -f "${wheels[0]}" ] || { echo "no /tmp/staged/.vllm-wheels: make vllm_stage.py's calls first" >&2; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${wheels[@]}" || exit 1
  # The plugin's entry point, from pyproject.toml, as a distribution importlib.metadata finds on the path.
  python3 - "$SITE" <<'PY' || exit 1
import sys, tomllib
from pathlib import Path
project = tomllib.loads(Path("pyproject.toml").read_text())["project"]
info = Path(sys.argv[1]) / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
info.mkdir(exist_ok=True)
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
groups = project["entry-points"]
sections = [f"[{group}]\n" + "".join(f"{name} = {target}\n" for name, target in points.items())
            for group, points in groups.items()]
(info / "entry_points.txt").write_text("".join(sections))
PY
  touch "$SITE/.sparrow-vllm"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# vLLM's engine core starts in a fresh process (the tests' native engines hold CUDA already), offline.
export VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
export VLLM_CACHE_ROOT=/tmp/vllm-cache TOKENIZERS_PARALLELISM=false
# Model Runner V2's sampler imports FlashInfer (not carried: 101 MiB and 7 more packages) unless this is off; vLLM's
# own top-k/top-p sampler is used instead.
export VLLM_USE_FLASHINFER_SAMPLER=0
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
timeout "${TESTS_S:-480}" python3 -m pytest -m gpu tests/test_vllm_gpu.py -q -rfEs -p no:cacheprovider --durations=0 \
  --junitxml="$OUT/vllm-gpu-junit.xml" "$@" 2>&1 | tee "$OUT/vllm-gpu-tests.log"
