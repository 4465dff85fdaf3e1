#!/usr/bin/env bash
# The peer kernel for `sparrow bench kernels` on a GPU machine with no package index: FlashInfer's wheels, split
# into two carry folders under the 64 MiB one device call takes.
#
#   bash benchmarks/flashinfer_stage.sh        run here, from the checkout's root (needs pip and the index)
#
# Downloads flashinfer-python 0.7.2.post1 (62 MB, pure Python + CUDA sources it JIT-compiles with the machine's
# nvcc) and what `import flashinfer` and its JIT need beyond the GPU image (apache-tvm-ffi, nvidia-cudnn-frontend,
# cuda-tile; cuda-bindings, nvidia-ml-py, ninja and torch are already there), as one tar split into
# .fi-a/part00 and .fi-b/part01 (about 38 MiB each). On the GPU machine, one call carries .fi-a and runs
#
#   cp -r .fi-a /tmp/fi-a
#
# and the next (within 30 s, while the machine is warm) carries .fi-b and starts with
#
#   bash .fi-b/install.sh /tmp/site && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
#
# after which `sparrow bench kernels` times FlashInfer beside Sparrow's kernels (docs/performance.md).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
EXCLUDE=$(git rev-parse --git-path info/exclude)
for d in /.fi-a/ /.fi-b/; do grep -qxF "$d" "$EXCLUDE" 2>/dev/null || echo "$d" >> "$EXCLUDE"; done
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/wheels"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$tmp/wheels" flashinfer-python==0.7.2.post1 apache-tvm-ffi==0.1.15.post2 \
  nvidia-cudnn-frontend==1.32.0 cuda-tile==1.7.0 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }
tar cf "$tmp/wheels.tar" -C "$tmp" wheels
rm -rf .fi-a .fi-b; mkdir -p .fi-a .fi-b
split -n 2 -d "$tmp/wheels.tar" "$tmp/part"
mv "$tmp/part00" .fi-a/; mv "$tmp/part01" .fi-b/
sha256sum "$tmp/wheels.tar" | cut -d' ' -f1 > .fi-b/SHA256
cat > .fi-b/install.sh <<'SH'
#!/usr/bin/env bash
# Joins /tmp/fi-a/part00 (or .fi-a/part00) + .fi-b/part01, checks the SHA-256 and installs the wheels into $1.
set -euo pipefail
target=${1:?usage: bash .fi-b/install.sh TARGET_DIR}
here=$(cd "$(dirname "$0")/.." && pwd)
a=/tmp/fi-a/part00; [ -f "$a" ] || a="$here/.fi-a/part00"
[ -f "$a" ] || { echo "part00 missing: carry .fi-a in the call before this one and copy it to /tmp/fi-a" >&2; exit 1; }
cat "$a" "$here/.fi-b/part01" > /tmp/fi-wheels.tar
[ "$(sha256sum /tmp/fi-wheels.tar | cut -d' ' -f1)" = "$(cat "$here/.fi-b/SHA256")" ] || { echo "wheels checksum mismatch" >&2; exit 1; }
rm -rf /tmp/fi-wheels; tar xf /tmp/fi-wheels.tar -C /tmp && mv /tmp/wheels /tmp/fi-wheels
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$target" /tmp/fi-wheels/*.whl
PYTHONPATH=$target${PYTHONPATH:+:$PYTHONPATH} python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__, 'in $target')"
SH
du -sh .fi-a .fi-b
