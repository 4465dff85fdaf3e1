# Sourced on a lent GPU machine: vLLM (staged by benchmarks/vllm_stage.py's calls and assembled under /tmp/staged)
# installed once into /tmp/vllm-site (with the torch and CUDA libraries of a release that pins another torch than
# the machine's: first on the path), with Sparrow's plugin entry point beside it (the checkout is not pip-installed
# there: gpu_env.sh links its folders into the sparrow package), and the environment vLLM runs offline in. Used by
# vllm_gpu.sh (the GPU tests) and by any command that runs the vLLM backend there, e.g.
#   source benchmarks/vllm_env.sh && python3 -m sparrow.cli.main bench rollout-engine --engine vllm ...
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
SITE=/tmp/vllm-site
# The stamp names the staged wheel set: staging another release on a warm machine installs afresh.
wheels=(/tmp/staged/.vllm-wheels/*.whl)
stamp=$(ls /tmp/staged/.vllm-wheels 2>/dev/null | sha256sum | cut -c1-16)
if [ "$(cat "$SITE/.sparrow-vllm" 2>/dev/null)" != "$stamp" ]; then
  [ -f "${wheels[0]}" ] || { echo "no /tmp/staged/.vllm-wheels: make vllm_stage.py's calls first" >&2; return 1; }
  rm -rf "$SITE"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "${wheels[@]}" || return 1
  # The plugin's entry point, from pyproject.toml, as a distribution importlib.metadata finds on the path.
  python3 - "$SITE" <<'PY' || return 1
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
  # A carried torch finds its CUDA libraries through its RPATH ($ORIGIN/../../nvidia/*/lib): the ones carried beside
  # it, and the image's others (cu13, nvshmem, ...) linked in.
  if [ -d "$SITE/torch" ]; then
    image=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    mkdir -p "$SITE/nvidia"
    for lib in "$image"/nvidia/*/; do
      lib=${lib%/}; [ -e "$SITE/nvidia/${lib##*/}" ] || ln -s "$lib" "$SITE/nvidia/${lib##*/}"
    done
  fi
  echo "$stamp" > "$SITE/.sparrow-vllm"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
# vLLM's engine core starts in a fresh process (the tests' native engines hold CUDA already), offline.
export VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1
export VLLM_CACHE_ROOT=/tmp/vllm-cache TOKENIZERS_PARALLELISM=false
# Model Runner V2's sampler imports FlashInfer (not carried: 101 MiB and 7 more packages) unless this is off; vLLM's
# own top-k/top-p sampler is used instead.
export VLLM_USE_FLASHINFER_SAMPLER=0
