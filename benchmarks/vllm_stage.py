"""The Python wheels vLLM needs on the lent GPU machine (no package index there), staged for `stage-big.sh`.

    python3 benchmarks/vllm_stage.py [--version 0.26.0] [--part-mib N]   (checkout root; needs pip and the index)

Which wheels: vLLM's METADATA `Requires-Dist` for CPython 3.12 on Linux x86_64 (extras skipped), less what the GPU
machine's image has (`GPU_HAS`: KINDS.md's package list of the 'cuda' image, read there on 2026-11-17) at a version
the pin admits (`MACHINE_VERSIONS`, where known), and less what `AsyncLLM` / `LLM` import lazily or only for the
HTTP server (`LAZY`). A pin the image's version misses swaps that package: vLLM 0.33 pins torch 2.14.0 and
torchvision 0.29.0, so both are carried, with each of torch's own pins the image misses in turn (cuDNN, NCCL,
cuSPARSELt, Triton), and installed ahead of the image's copies on the path. What is left (`RUNTIME`, each with where
vLLM 0.26 imports it at module level) is downloaded with what it needs in turn; every `Requires-Dist` of every
carried wheel must then be carried or on the machine at a fitting version. A requirement in none of the three lists
stops the script: read where that vLLM imports it and file it. The wheels land in `.vllm-wheels/` (git-ignored);
`../shared/tools/stage-big.sh` splits them into parts that fit one device call beside the checkout, and the script
prints the calls to make, the last of which runs `benchmarks/vllm_gpu.sh` (it installs the wheels there).
"""

import argparse
import math
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

WHEELS = Path(".vllm-wheels")
CALL_MIB = 64
"""What one device call carries: the checkout plus the carried folders."""
PLATFORMS = (*(f"manylinux_2_{minor}_x86_64" for minor in range(28, 4, -1)),
             "manylinux2014_x86_64", "manylinux1_x86_64")
"""glibc 2.28 and older: the machine ran vLLM's manylinux_2_28 wheel (pip matches a wheel's tags exactly)."""
TARGET = ["--python-version", "3.12", "--implementation", "cp", *(a for p in PLATFORMS for a in ("--platform", p))]
MARKERS = {"implementation_name": "cpython", "implementation_version": "3.12.3", "os_name": "posix",
           "platform_machine": "x86_64", "platform_python_implementation": "CPython", "platform_release": "",
           "platform_system": "Linux", "platform_version": "", "python_full_version": "3.12.3",
           "python_version": "3.12", "sys_platform": "linux", "extra": ""}

GPU_HAS = set(map(canonicalize_name, """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft
pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()))
MACHINE_VERSIONS = {
    # KINDS.md's pip list of the image (2026-11)
    "torch": "2.11.0", "torchaudio": "2.11.0", "torchvision": "0.26.0", "triton": "3.6.0", "transformers": "5.17.0",
    "tokenizers": "0.23.2", "safetensors": "0.8.0", "huggingface-hub": "1.33.0", "numpy": "2.5.2",
    # the pins in torch 2.11.0's METADATA, which the image's torch (2.11.0+cu130) was installed with
    "cuda-toolkit": "13.0.2", "nvidia-cudnn-cu13": "9.19.0.56", "nvidia-cusparselt-cu13": "0.8.0",
    "nvidia-nccl-cu13": "2.28.9", "nvidia-nvshmem-cu13": "3.4.5",
}
SAME_ABI = {"cuda-toolkit": "a patch release of the same CUDA minor: the same sonames, and every cuBLAS and CUDA "
                            "runtime symbol torch 2.14.0's libraries import is defined by 13.0.2's (cuBLAS 13.1.0.3 "
                            "against 13.0.3's 13.1.1.3, runtime 13.0.96 in both; nm -D, 2026-12-08)"}
"""Unlike NCCL: torch 2.14.0 imports 11 symbols NCCL 2.28.9 lacks (ncclCommGrow, ncclCommSuspend, ...), so it is
carried. cuDNN 9.19 and cuSPARSELt 0.8.0 define every symbol it imports, but torch refuses a cuDNN older than its
build at first use, so both are carried too (they are its pins)."""
FORCE = {"typing-extensions": "there, but pydantic needs a newer one than the image may hold (device-wheels.sh too)"}

RUNTIME = {
    "pydantic": "vllm.config.* (every config class)",
    "fastapi": "vllm.v1.engine.async_llm -> entrypoints.serve.elastic_ep.middleware",
    "starlette": "the same middleware",
    "openai": "vllm.config -> reasoning -> entrypoints.mcp.tool; LLM -> entrypoints.chat_utils",
    "openai-harmony": "the same two modules",
    "partial-json-parser": "LLM -> entrypoints.chat_utils -> tool_parsers.utils",
    "msgspec": "vllm.pooling_params, lora.request, the engine-core wire format",
    "pyzmq": "v1.engine.core_client, distributed.device_communicators.shm_broadcast",
    "cbor2": "vllm.utils.hashing (prefix-cache block hashes)",
    "cachetools": "vllm.utils.cache",
    "pybase64": "vllm.multimodal.media (reached from every model's utils)",
    "llguidance": "v1.engine.core -> v1.structured_output -> backend_guidance (a class annotation loads it)",
    "xgrammar": "the same package -> backend_xgrammar",
    "apache-tvm-ffi": "xgrammar.exception, at its import",
    "oss-harmony": "vLLM 0.33's openai_harmony module (a fork of openai-harmony): renderers.chat_utils.types",
}
ALONE = {"llguidance", "xgrammar", "apache-tvm-ffi"}
"""Only imported, never used (Sparrow's requests ask for no structured output): carried at the newest release the
index has, not at vLLM's pins (vLLM 0.26.0 pins llguidance 1.7.x, which the index lacks, and apache-tvm-ffi 0.1.10,
older than xgrammar 0.2.9 needs; 1.6.1 and 0.1.15 import and served the H200 run), and without their requirements,
which are all on the machine (xgrammar's include torch and triton, which a download with dependencies would fetch
in full); `closure_problems` checks that."""
LAZY_BY_REASON = {
    "the HTTP server": ["prometheus-fastapi-instrumentator", "anthropic", "model-hosting-container-standards",
                        "watchfiles", "ijson", "mcp", "python-json-logger", "orjson"],
    "structured output, imported when a request asks for it": ["lm-format-enforcer", "outlines-core", "lark",
                                                               "jsonschema"],
    "optional, ImportError caught": ["setproctitle", "fastsafetensors", "opentelemetry-sdk", "opentelemetry-api",
                                     "opentelemetry-exporter-otlp", "opentelemetry-semantic-conventions-ai"],
    "kernels of other attention / MoE / quantization backends, imported when one is chosen (dense Qwen3 and Llama "
    "on Hopper take FLASH_ATTN, which the vLLM wheel holds)": [
        "flashinfer-python", "tilelang", "nvidia-cudnn-frontend", "nvidia-cutlass-dsl",
        "quack-kernels", "tokenspeed-mla", "humming-kernels"],
    "inputs and models Sparrow does not use (Mistral tokenizers, quantized checkpoints, images, video)": [
        "mistral-common", "compressed-tensors", "blake3", "torchcodec", "pynvvideocodec",
        "instanttensor"],
    "debugging and profiling switches": ["depyf", "nvtx"],
}
LAZY = {name: reason for reason, names in LAZY_BY_REASON.items() for name in names}


def pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "-q", "--disable-pip-version-check"], check=True)


def requirements(wheel: Path) -> list[Requirement]:
    """A wheel's `Requires-Dist` that apply to CPython 3.12 on Linux x86_64, extras left out."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        header = z.read(meta).decode("utf-8", "replace").split("\n\n", 1)[0]
    lines = [line.split(":", 1)[1].strip() for line in header.splitlines() if line.startswith("Requires-Dist:")]
    reqs = list(map(Requirement, lines))
    return [r for r in reqs if r.marker is None or r.marker.evaluate(MARKERS)]


def machine_fits(req: Requirement) -> bool:
    """Whether the image's copy serves `req`: its version admitted where known (or of the same ABI), else assumed."""
    name = canonicalize_name(req.name)
    if name not in GPU_HAS:
        return False
    have = MACHINE_VERSIONS.get(name)
    if have is None or req.specifier.contains(have, prereleases=True):
        return True
    pinned = [Version(s.version).release[:2] for s in req.specifier if s.operator == "=="]
    return name in SAME_ABI and pinned == [Version(have).release[:2]]


def classify(reqs: list[Requirement]) -> tuple[list[Requirement], list[Requirement], list[str], dict[str, list[str]]]:
    """vLLM's requirements → (to carry, to swap for the image's copy, assumed on the machine, left out by reason);
    unknown names stop the script."""
    carry, swap, there, left = [], [], [], {}
    unknown = []
    for req in reqs:
        name = canonicalize_name(req.name)
        if name in RUNTIME:
            carry.append(Requirement(f"{name}{req.specifier}"))
        elif name in GPU_HAS and not machine_fits(req):
            swap.append(Requirement(f"{name}{req.specifier}"))
        elif name in GPU_HAS:
            there.append(f"{name}{req.specifier}")
        elif name in LAZY:
            left.setdefault(LAZY[name], []).append(name)
        else:
            unknown.append(str(req))
    if unknown:
        sys.exit(f"vllm requires {unknown}, which this script does not file: read where vLLM imports each and add it "
                 "to RUNTIME or LAZY in benchmarks/vllm_stage.py")
    return carry, swap, there, left


def download_swaps(swap: list[Requirement], dest: Path) -> list[str]:
    """Each swapped package without its requirements, then each of those the machine's versions miss, in turn; the
    rest of their requirements are on the machine (`closure_problems` checks). Returns what was swapped, for the
    printout."""
    done, queue = [], list(swap)
    while queue:
        req = queue.pop(0)
        name = canonicalize_name(req.name)
        if name in done:
            continue
        pip("download", "--no-deps", "--only-binary=:all:", *TARGET, "-d", str(dest), str(req))
        done.append(name)
        (wheel,) = [w for w in dest.glob("*.whl") if parse_wheel_filename(w.name)[0] == name]
        queue += [r for r in requirements(wheel) if canonicalize_name(r.name) in GPU_HAS and not machine_fits(r)]
    return done


def closure_problems(wheels: list[Path]) -> list[str]:
    """Every requirement of every carried wheel is carried at a fitting version, or on the machine."""
    carried = {parse_wheel_filename(w.name)[0]: (parse_wheel_filename(w.name)[1], w) for w in wheels}
    problems = []
    for name, (_, wheel) in sorted(carried.items()):
        for req in requirements(wheel):
            dep = canonicalize_name(req.name)
            if dep in carried and not req.specifier.contains(carried[dep][0], prereleases=True):
                problems.append(f"{name} needs {req}, carried {dep} {carried[dep][0]}")
            elif dep not in carried and not machine_fits(req):
                have = MACHINE_VERSIONS.get(dep)
                problems.append(f"{name} needs {req}: not carried, and the GPU machine has "
                                + (f"{dep} {have}" if have else "none"))
    return problems


def tree_mib() -> float:
    """What the checkout sends with every call (tracked and untracked-not-ignored files)."""
    files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], capture_output=True, check=True)
    return sum(p.stat().st_size for p in map(Path, files.stdout.decode().split("\0")) if p.is_file()) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default="0.26.0",
                        help="vLLM release (0.26.x pins the machine's torch, 2.11; a later one carries its own)")
    parser.add_argument("--part-mib", type=int, help="part size (default: what fits beside the checkout, at most 58)")
    args = parser.parse_args()
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=True)
    root = Path(top.stdout.strip())
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        pip("download", "--no-deps", "--only-binary=:all:", *TARGET, "-d", str(tmp / "vllm"), f"vllm=={args.version}")
        (vllm_wheel,) = (tmp / "vllm").glob("*.whl")
        carry, swap, there, left = classify(requirements(vllm_wheel))
        alone = [r for r in carry if canonicalize_name(r.name) in ALONE]
        pip("download", "--only-binary=:all:", *TARGET, "-d", str(tmp / "deps"), *(str(r) for r in carry if r not in alone))
        pip("download", "--no-deps", "--only-binary=:all:", *TARGET, "-d", str(tmp / "deps"), *(r.name for r in alone))
        wheels = [w for w in sorted((tmp / "deps").glob("*.whl"))
                  if (name := parse_wheel_filename(w.name)[0]) not in GPU_HAS or name in FORCE]
        swapped = download_swaps(swap, tmp / "swap")
        wheels += sorted((tmp / "swap").glob("*.whl"))
        problems = closure_problems(wheels)
        if problems:
            sys.exit("requirement problems:\n  " + "\n  ".join(problems))
        pip("install", "--no-index", "--no-deps", "--no-compile", "--only-binary=:all:", *TARGET,
            "--target", str(tmp / "site"), *map(str, wheels))
        shutil.rmtree(root / WHEELS, ignore_errors=True)
        (root / WHEELS).mkdir()
        for wheel in [vllm_wheel, *wheels]:
            shutil.copy2(wheel, root / WHEELS / wheel.name)
    print(f"vllm {args.version}: assumed on the GPU machine: {', '.join(there)}")
    if swapped:
        print(f"carried in place of the machine's own (ahead of them on the path): {', '.join(swapped)}")
    print("left out (imported lazily or by the HTTP server only):")
    for reason, names in left.items():
        print(f"  {reason}: {', '.join(names)}")
    staged = sorted((root / WHEELS).glob("*.whl"), key=lambda w: -w.stat().st_size)
    for wheel in staged:
        print(f"{wheel.stat().st_size / 2**20:9.2f} MiB  {wheel.name}")
    total = sum(w.stat().st_size for w in staged) / 2**20
    tree = tree_mib()
    part = args.part_mib or min(58, CALL_MIB - math.ceil(tree) - 2)
    if part < 8:
        sys.exit(f"the checkout sends {tree:.1f} MiB with every call, which leaves no room for parts of the "
                 f"{CALL_MIB} MiB a call carries")
    print(f"{total:9.2f} MiB  in {len(staged)} wheels; the checkout sends {tree:.1f} MiB a call: parts of {part} MiB")
    stage_big = root.parent / "shared" / "tools" / "stage-big.sh"
    if not stage_big.exists():
        print(f"\nthen: bash ../shared/tools/stage-big.sh --part-mib {part} {WHEELS}")
        return
    subprocess.run(["bash", str(stage_big), "--part-mib", str(part), str(WHEELS)], cwd=root, check=True)
    parts = sorted(p.name for p in root.glob(".stage-[0-9][0-9]"))
    print("\nDevice calls, back to back (a reply with warm: false means /tmp is gone: start again at the first):")
    for name in parts[:-1]:
        print(f'  carry ["{name}"]  command: bash {name}/recv.sh')
    last = parts[-1]
    print(f'  carry ["{last}"]  command: bash {last}/recv.sh && bash {last}/assemble.sh /tmp/staged '
          "&& bash benchmarks/vllm_gpu.sh")


if __name__ == "__main__":
    main()
