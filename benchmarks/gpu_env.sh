# Sourced by the GPU benchmark scripts: the environment of a lent GPU machine with no package index.
# Carried wheels (.whl, from ../shared/tools/device-wheels.sh) install into /tmp/site; the repo's folders
# become the sparrow.* packages through symlinks when Sparrow is not installed (setup.py maps them).
# .whl (57 MiB) and the checkout (~10 MiB) no longer fit one call's 64 MiB: carry ray's wheel (44 MiB) in a call
# of its own and install it into /tmp/site the same way (pip ... --target /tmp/site-ray; cp -a /tmp/site-ray/. /tmp/site/).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
# The stamp keeps scripts sourced side by side on a warm machine (one per GPU) from installing into /tmp/site at once.
if [ -d .whl ] && [ ! -e /tmp/site/.sparrow-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.sparrow-wheels
fi
[ -d /tmp/site ] && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
# -P: without the current folder on the path, as a script under benchmarks/ sees it (the cwd would hide a
# missing PYTHONPATH once the symlinks exist).
if ! python3 -P -c "import sparrow.bench, sparrow.rollout_workers.native" 2>/dev/null; then
  for pkg in coordinator kernels protos rollout_workers trainer; do [ -e "sparrow/$pkg" ] || ln -s "../$pkg" "sparrow/$pkg"; done
  [ -e sparrow/bench ] || ln -s ../benchmarks sparrow/bench
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
