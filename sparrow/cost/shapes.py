"""Model shapes: the few numbers of a decoder that decide its decode cost.

The built-in Qwen3 shapes are the published `config.json` values of Qwen/Qwen3-{0.6B,...,14B} on the
Hugging Face hub; their parameter counts, computed here from those values, match the model cards
(0.6B/0.44B, 1.7B/1.4B, 4.0B/3.6B, 8.2B/6.95B, 14.8B/13.2B total/non-embedding; see tests).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from sparrow.architecture import config_path, decoder_facts, read_model_config


@dataclass(frozen=True)
class ModelShape:
    """A dense GQA decoder (Llama / Qwen2 / Qwen3 layout: attention + gated MLP, RMSNorm).

    `qk_norm` adds Qwen3's per-head q/k RMSNorm; `bias_per_layer` counts attention/MLP bias
    parameters (Qwen2's q/k/v biases, Llama's `attention_bias` / `mlp_bias`).
    """

    name: str
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qk_norm: bool = False
    bias_per_layer: int = 0

    def __post_init__(self):
        for f in ("layers", "q_heads", "kv_heads", "head_dim", "hidden", "intermediate", "vocab"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model {self.name!r}: {f}={value!r} must be a positive integer")
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"model {self.name!r}: q_heads={self.q_heads} is not a multiple of kv_heads={self.kv_heads}; "
                "GQA needs every KV head to serve the same number of query heads"
            )

    @property
    def gqa_ratio(self) -> int:
        """r: query heads per KV head."""
        return self.q_heads // self.kv_heads

    @property
    def kv_dim(self) -> int:
        """D of the paper: K (or V) elements per token over all layers = layers · kv_heads · head_dim."""
        return self.layers * self.kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        attention = 2 * self.hidden * q + 2 * self.hidden * kv + (2 * self.head_dim if self.qk_norm else 0)
        mlp = 3 * self.hidden * self.intermediate
        return attention + mlp + 2 * self.hidden + self.bias_per_layer

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def non_embedding_params(self) -> int:
        """What model cards call 'non-embedding' (input embedding and LM head both excluded)."""
        return self.layers * self.params_per_layer + self.hidden

    @property
    def params(self) -> int:
        """All parameters, as a model card counts them (a tied LM head counted once)."""
        heads = 1 if self.tied_embeddings else 2
        return self.non_embedding_params + heads * self.embedding_params

    @property
    def decode_params(self) -> int:
        """P of the cost model: weights every decoded token multiplies with (layers + LM head).

        The input embedding only contributes one row per token, so it is left out whether or not it
        is tied to the LM head.
        """
        return self.non_embedding_params + self.embedding_params

    @classmethod
    def from_hf_config(cls, source: str | Path | Mapping[str, Any], name: str | None = None) -> "ModelShape":
        """Shape of a Hugging Face `config.json` (a dict, the file, or the model directory holding it)."""
        if isinstance(source, Mapping):
            config, origin = dict(source), name or "config"
        else:
            path = config_path(source)
            config, origin = read_model_config(path), str(path)
            name = name or path.parent.name
        config = config.get("text_config", config)
        model_type = config.get("model_type", "")
        if "num_experts" in config or "num_local_experts" in config:
            raise ValueError(f"model config {origin}: mixture-of-experts models are not supported by the cost model")

        def need(key: str):
            if config.get(key) is None:
                raise ValueError(
                    f"model config {origin}: missing key {key!r} (model_type={model_type or 'unset'}); "
                    "the cost model needs hidden_size, intermediate_size, num_hidden_layers, "
                    "num_attention_heads and vocab_size"
                )
            return config[key]

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        intermediate, layers, vocab = need("intermediate_size"), need("num_hidden_layers"), need("vocab_size")
        facts = decoder_facts(config, model_type)
        q, kv = facts.num_heads * facts.head_dim, facts.num_kv_heads * facts.head_dim
        bias = (q + 2 * kv if facts.qkv_bias else 0) + (hidden if facts.o_bias else 0)
        if facts.mlp_bias:
            bias += 2 * intermediate + hidden
        return cls(
            name=name or config.get("_name_or_path") or model_type or "model",
            layers=layers, q_heads=heads, kv_heads=facts.num_kv_heads, head_dim=facts.head_dim, hidden=hidden,
            intermediate=intermediate, vocab=vocab, tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            qk_norm=facts.qk_norm, bias_per_layer=bias,
        )


def _qwen3(name: str, layers: int, q_heads: int, hidden: int, intermediate: int, tied: bool) -> ModelShape:
    return ModelShape(name=name, layers=layers, q_heads=q_heads, kv_heads=8, head_dim=128, hidden=hidden,
                      intermediate=intermediate, vocab=151936, tied_embeddings=tied, qk_norm=True)


BUILTIN_MODELS: dict[str, ModelShape] = {
    s.name: s
    for s in (
        _qwen3("qwen3-0.6b", 28, 16, 1024, 3072, tied=True),
        _qwen3("qwen3-1.7b", 28, 16, 2048, 6144, tied=True),
        _qwen3("qwen3-4b", 36, 32, 2560, 9728, tied=True),
        _qwen3("qwen3-8b", 36, 32, 4096, 12288, tied=False),
        _qwen3("qwen3-14b", 40, 40, 5120, 17408, tied=False),
    )
}


def resolve_model(name_or_path: str) -> ModelShape:
    """A built-in shape by name, or the shape of an HF config.json / model directory."""
    key = str(name_or_path).lower()
    if key in BUILTIN_MODELS:
        return BUILTIN_MODELS[key]
    path = Path(name_or_path)
    if path.is_dir() or path.is_file():
        return ModelShape.from_hf_config(path)
    raise ValueError(
        f"unknown model {name_or_path!r}: choose one of {', '.join(BUILTIN_MODELS)} "
        "or give a path to an HF config.json or model directory"
    )
