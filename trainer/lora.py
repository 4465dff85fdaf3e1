"""DistillSparse's adapter: a peft LoRA that only the sparse forward uses.

The policy's own weights W are never modified: rollout workers get W + (α/r)·B·A computed on the
fly per layer (`export.WeightExporter`), and the dense forward runs with the adapter disabled, which in peft
calls the base layer alone, so dense log-probs are those of the adapter-free model bit for bit.
"""

import torch

from .config import DistillSparseConfig
from .forward import WRAPPER_PREFIX

PEFT_PREFIX = "base_model.model."


def attach_lora(model: torch.nn.Module, config: DistillSparseConfig) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        target_modules=config.target_modules,
        lora_dropout=0.0,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def is_lora_param(name: str) -> bool:
    return "lora_" in name


def clean_name(name: str) -> str:
    """The adapter-free HF name of a parameter of the engine's module
    (`policy.base_model.model.model...q_proj.base_layer.weight` → `model...q_proj.weight`)."""
    return name.removeprefix(WRAPPER_PREFIX).removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Clean module name → peft LoRA layer."""
    from peft.tuners.lora import LoraLayer

    return {clean_name(n + "."): m for n, m in model.named_modules() if isinstance(m, LoraLayer)}



def adapter_state(named) -> dict[str, torch.Tensor]:
    """The adapter's tensors from (name, tensor) pairs of the engine's module (or its state dict),
    under peft's own names (`base_model.model.…q_proj.lora_A.default.weight`)."""
    return {name.removeprefix(WRAPPER_PREFIX): t for name, t in named if is_lora_param(name)}
