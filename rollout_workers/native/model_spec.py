"""What the engine needs to know about a decoder, read from an HF `config.json`.

Supported: Llama, Qwen2 and Qwen3 causal LMs (GQA attention, SiLU-gated MLP, RMSNorm, RoPE).
Anything else fails here with the field and the value that rule it out, before weights are read.
"""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sparrow.architecture import ModelConfigError, decoder_facts, read_json_object, read_model_config

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ModelLoadError(ModelConfigError):
    """A model directory that cannot be served: the message names the file or field and the fix."""


class WeightsError(ValueError):
    """A state dict that does not fit the model; the message names the key."""


@dataclass(frozen=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 10000.0})
    eos_token_ids: tuple[int, ...] = ()


def _eos_ids(*values: Any) -> tuple[int, ...]:
    ids: list[int] = []
    for v in values:
        for i in v if isinstance(v, list) else [v]:
            if isinstance(i, int) and i not in ids:
                ids.append(i)
    return tuple(ids)


def rope_parameters(config: dict, origin: str) -> dict:
    """RoPE settings in the `rope_parameters` form of transformers 5 (old `rope_scaling` accepted)."""
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ModelLoadError(f"{origin}: rope_parameters per layer type are not supported (one RoPE for all layers)")
    params["rope_type"] = params.get("rope_type") or params.pop("type", None) or "default"
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if params["rope_type"] not in ROPE_TYPES:
        raise ModelLoadError(
            f"{origin}: rope_type={params['rope_type']!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ModelLoadError(f"{origin}: partial_rotary_factor={params['partial_rotary_factor']} is not supported (need 1.0)")
    if params["rope_type"] in ("llama3", "yarn"):
        params.setdefault(
            "original_max_position_embeddings",
            config.get("original_max_position_embeddings", config.get("max_position_embeddings")),
        )
    needed = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": ("factor",)}
    for key in needed.get(params["rope_type"], ()):
        if params.get(key) is None:
            raise ModelLoadError(f"{origin}: rope_type={params['rope_type']!r} needs rope field {key!r}")
    return params


def spec_from_config(config: dict, origin: str = "config.json", generation_config: dict | None = None) -> ModelSpec:
    """Validate an HF config dict and turn it into a `ModelSpec`."""
    archs = config.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(
            f"{origin}: architectures={archs!r} is not supported; the native engine serves "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    family = SUPPORTED_ARCHITECTURES[arch]

    def need(key: str, kind=int):
        value = config.get(key)
        if value is None or isinstance(value, bool) or not isinstance(value, kind) or value <= 0:
            raise ModelLoadError(f"{origin}: field {key!r}={value!r} must be a positive {kind.__name__}")
        return value

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    facts = decoder_facts(config, family)
    if heads % facts.num_kv_heads:
        raise ModelLoadError(
            f"{origin}: num_attention_heads={heads} is not a multiple of num_key_value_heads={facts.num_kv_heads}"
        )
    if config.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"{origin}: hidden_act={config['hidden_act']!r} is not supported (need 'silu')")
    if config.get("use_sliding_window") or (family == "llama" and config.get("sliding_window")):
        raise ModelLoadError(f"{origin}: sliding-window attention is not supported (use_sliding_window must be false)")
    layer_types = config.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ModelLoadError(f"{origin}: layer_types other than 'full_attention' are not supported: {sorted(set(layer_types))}")
    gen = generation_config or {}
    return ModelSpec(
        family=family,
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=facts.num_kv_heads,
        head_dim=facts.head_dim,
        rms_norm_eps=float(need("rms_norm_eps", float)),
        max_position_embeddings=need("max_position_embeddings"),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=facts.qkv_bias,
        o_bias=facts.o_bias,
        mlp_bias=facts.mlp_bias,
        qk_norm=facts.qk_norm,
        rope=rope_parameters(config, origin),
        eos_token_ids=_eos_ids(config.get("eos_token_id"), gen.get("eos_token_id")),
    )


def load_spec(model_dir: str | Path) -> ModelSpec:
    """`ModelSpec` of an HF model directory (config.json, optional generation_config.json)."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: not a directory; give an HF model directory (config.json + safetensors)")
    config = read_model_config(model_dir)
    gen_path = model_dir / "generation_config.json"
    generation = read_json_object(gen_path, "generation_config.json") if gen_path.is_file() else None
    return spec_from_config(config, str(model_dir / "config.json"), generation)
