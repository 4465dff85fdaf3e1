"""Model shapes by name for benchmarks: `sparrow cost`'s built-in shapes (qwen3-0.6b ... qwen3-14b) plus a
few extras, built as `ModelSpec`s and, with random weights, as models (speed depends on shapes only)."""

from pathlib import Path

from .model_spec import ModelSpec

EXTRA_SHAPES = {
    # name: (family, layers, q heads, kv heads, head_dim, hidden, intermediate, vocab, tied, rope theta, max positions)
    "smollm2-135m": ("llama", 30, 9, 3, 64, 576, 1536, 49152, True, 100000.0, 8192),
    "tiny": ("qwen3", 4, 4, 2, 32, 64, 128, 2048, True, 1000000.0, 4096),
}


def shape_names() -> list[str]:
    from sparrow.cost import BUILTIN_MODELS

    return [*EXTRA_SHAPES, *BUILTIN_MODELS]


def spec_for_shape(name: str) -> ModelSpec:
    """A `ModelSpec` for a shape name: sparrow.cost's built-in shapes or EXTRA_SHAPES."""
    from sparrow.cost import BUILTIN_MODELS

    key = name.lower()
    if key in EXTRA_SHAPES:
        family, layers, q, kv, d, hidden, inter, vocab, tied, theta, max_pos = EXTRA_SHAPES[key]
    elif key in BUILTIN_MODELS:
        s = BUILTIN_MODELS[key]
        family = "qwen3" if s.qk_norm else "llama"
        layers, q, kv, d, hidden, inter, vocab, tied = (s.layers, s.q_heads, s.kv_heads, s.head_dim, s.hidden,
                                                        s.intermediate, s.vocab, s.tied_embeddings)
        theta, max_pos = 1000000.0, 40960
    else:
        raise ValueError(f"--model {name!r}: not a directory and not a shape; shapes: {', '.join(shape_names())}")
    return ModelSpec(
        family=family, vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers, num_heads=q,
        num_kv_heads=kv, head_dim=d, rms_norm_eps=1e-6, max_position_embeddings=max_pos, tie_word_embeddings=tied,
        qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=family == "qwen3",
        rope={"rope_type": "default", "rope_theta": theta},
    )


def model_spec(name: str) -> ModelSpec:
    """The spec of `--model`: an HF directory's config.json, or a shape name."""
    from .model_spec import load_spec

    return load_spec(name) if Path(name).is_dir() else spec_for_shape(name)


def build_model(name: str, device, dtype, max_len: int, seed: int = 0, tensor_parallel_size: int = 1):
    """An HF directory's model, or a shape with random weights (positions up to the shape's maximum); with
    `tensor_parallel_size` > 1, this rank's shard (torch.distributed's default group)."""
    from .model import DecoderModel
    from .model_loader import load_model
    from .tensor_parallel import TensorParallel

    if Path(name).is_dir():
        return load_model(name, device, dtype, tensor_parallel_size=tensor_parallel_size)
    spec = spec_for_shape(name)
    if max_len > spec.max_position_embeddings:
        raise ValueError(f"{max_len} tokens exceed {name}'s {spec.max_position_embeddings} positions")
    tensor_parallel = TensorParallel.join(spec, tensor_parallel_size)
    return DecoderModel(spec, spec.max_position_embeddings, device=device, dtype=dtype,
                        tensor_parallel=tensor_parallel).init_random(seed)
