#!/usr/bin/env bash
# One arm of the stability study (docs/stability.md) on a GPU machine where Sparrow is not installed:
# gpu_env.sh makes the carried wheels and the repo's folders (as `sparrow.*`) importable, then
# benchmarks/stability_study.py runs with the given options.
# Usage (repo root): benchmarks/stability_gpu.sh --arm b --config deploy/configs/smollm2-longctx-h200.yaml ...
set -uo pipefail
source "$(dirname "$0")/gpu_env.sh"
exec python3 benchmarks/stability_study.py "$@"
