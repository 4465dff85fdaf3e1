"""Random-weight Hugging Face checkpoints of a model shape, for the benchmarks that run a real engine or job on one
(the weights decide nothing a benchmark measures; the shape does)."""

import json
from pathlib import Path


def shape_checkpoint(shape: str, out_dir: Path, device: str) -> Path:
    """A Hugging Face directory of `shape` with random weights (bf16 for CUDA), built once per shape and device."""
    import torch

    from sparrow.model_zoo.tiny import build_tiny_checkpoint
    from sparrow.rollout_workers.native.shapes import spec_for_shape

    out = out_dir / f"{shape}-{device}"
    if (out / "config.json").is_file():
        return out
    s = spec_for_shape(shape)
    return build_tiny_checkpoint(
        out, family=s.family, dtype=torch.bfloat16 if device == "cuda" else torch.float32,
        hidden_size=s.hidden_size, intermediate_size=s.intermediate_size, num_hidden_layers=s.num_layers,
        num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim,
        tie_word_embeddings=s.tie_word_embeddings, max_position_embeddings=s.max_position_embeddings)


def checkpoint_config(model_dir: Path) -> dict:
    """The checkpoint's `config.json` (its vocabulary and shape, which the benchmarks' prompts and KV sizing need)."""
    return json.loads((model_dir / "config.json").read_text())
