"""What a Llama / Qwen2 / Qwen3 `config.json` says about its decoder's attention and projections.

Read one way for every user — the native engine's `ModelSpec`, the cost model's `ModelShape` and the
vLLM backend's KV budget split — so the defaults (KV heads, head size) and the family rules (Qwen2's
hard-wired q/k/v biases, Qwen3's q/k norm) cannot drift apart. Each user validates the raw sizes its
own way before asking.
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecoderFacts:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    """q/k/v projections carry a bias (always in Qwen2, else with `attention_bias`)."""
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    """Qwen3's per-head RMSNorm of q and k."""


def decoder_facts(config: Mapping[str, Any], family: str) -> DecoderFacts:
    """Facts of a config with `hidden_size` and `num_attention_heads` set; `family` is llama, qwen2 or qwen3
    (the `model_type`)."""
    heads = config["num_attention_heads"]
    attention_bias = bool(config.get("attention_bias", False))
    return DecoderFacts(
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        qkv_bias=family == "qwen2" or attention_bias,
        o_bias=family != "qwen2" and attention_bias,
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=family == "qwen3",
    )
