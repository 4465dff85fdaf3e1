"""Writing a state dict as a Hugging Face checkpoint vLLM can load (the CPU weight-update path)."""

import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors.torch import save_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def save_checkpoint(state_dict: Mapping[str, torch.Tensor], base_dir: Path, out_dir: Path) -> Path:
    """`out_dir` = the non-weight files of `base_dir` (config, tokenizer, generation config) plus
    `state_dict` as one safetensors file. Tensors sharing storage (tied embeddings) are copied so
    safetensors can write them."""
    if not state_dict:
        raise ValueError("load_weights got an empty state dict")
    bad = [k for k, v in state_dict.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ValueError(f"state dict entries {bad[:5]} are not tensors")
    out_dir.mkdir(parents=True)
    for f in Path(base_dir).iterdir():
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"):
            shutil.copy2(f, out_dir / f.name)
    seen: set[int] = set()
    tensors = {}
    for name, tensor in state_dict.items():
        t = tensor.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir
