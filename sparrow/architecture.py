"""A model directory's `config.json`, what a Llama / Qwen2 / Qwen3 one says about its decoder's attention and
projections, and which safetensors files hold its weights.

Read one way for every user — the job (vocabulary size), the native engine's `ModelSpec`, the cost model's
`ModelShape` and the vLLM backend's KV budget split — so the file's errors, the defaults (KV heads, head
size) and the family rules (Qwen2's hard-wired q/k/v biases, Qwen3's q/k norm) cannot drift apart. Each
user validates the raw sizes its own way before asking.
"""

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class ModelConfigError(ValueError):
    """A `config.json` that cannot be read: the message names the file and the fix."""


class MissingModelConfig(ModelConfigError, FileNotFoundError):
    """No such file: a `FileNotFoundError` too, for callers that treat a missing path as one."""


def config_path(source: str | Path) -> Path:
    """The `config.json` of a model directory, or the file itself."""
    path = Path(source)
    return path / "config.json" if path.is_dir() else path


def read_json_object(path: Path, what: str) -> dict[str, Any]:
    """A JSON object file of a model directory (`what` names it in errors: config.json, generation_config.json)."""
    if not path.is_file():
        raise MissingModelConfig(f"{path}: missing {what} (no such file); give a Hugging Face model directory "
                                 "(config.json + *.safetensors)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelConfigError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ModelConfigError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def read_model_config(source: str | Path) -> dict[str, Any]:
    """The parsed `config.json` of a Hugging Face model directory (or of the file itself)."""
    return read_json_object(config_path(source), "config.json")


def safetensors_files(model_dir: str | Path, fix: str) -> list[Path]:
    """The safetensors files of a model directory: those its `model.safetensors.index.json` lists (each must exist),
    else every `*.safetensors` file. `fix` ends the error when there is none (what the reader needs instead)."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index, index.name).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelConfigError(f"{index}: not a valid safetensors index (no 'weight_map' of tensor name -> file)")
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelConfigError(f"{f}: listed in {index.name} but missing")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelConfigError(f"{model_dir}: no *.safetensors file; {fix}")
    return files


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
