"""Full policy tensors out of a DeepSpeed engine, a few at a time: gathered under ZeRO-3, with the
DistillSparse adapter merged (for rollout workers) or left out (for the clean policy)."""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .forward import PolicyModule
from .lora import clean_name, is_lora_param, lora_layers


class WeightExporter:
    """Names are the adapter-free HF names (`model.layers.0.self_attn.q_proj.weight`); tied weights
    appear once, under the name `named_parameters()` gives them."""

    def __init__(self, module: PolicyModule, zero3: bool):
        self.zero3 = zero3
        self.params: dict[str, torch.nn.Parameter] = {
            clean_name(n): p for n, p in module.named_parameters() if not is_lora_param(n)
        }
        self.lora = lora_layers(module) if module.is_peft else {}

    def shape(self, name: str) -> tuple[int, ...]:
        p = self.params[name]
        return tuple(p.ds_shape) if self.zero3 and hasattr(p, "ds_shape") else tuple(p.shape)

    def specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        return [(name, self.shape(name), p.dtype) for name, p in self.params.items()]

    @contextmanager
    def tensors(self, names: list[str], merge_lora: bool) -> Iterator[dict[str, torch.Tensor]]:
        """The full tensors of `names`, valid inside the context. Under ZeRO-3 every rank must enter."""
        params = [self.params[n] for n in names]
        if self.zero3:
            import deepspeed

            ctx = deepspeed.zero.GatheredParameters(params, modifier_rank=None)
        else:
            ctx = torch.no_grad()
        with ctx, torch.no_grad():
            yield {n: self._value(n, p, merge_lora) for n, p in zip(names, params)}

    def _value(self, name: str, param: torch.Tensor, merge_lora: bool) -> torch.Tensor:
        module_name, _, leaf = name.rpartition(".")
        layer = self.lora.get(module_name + ".") if merge_lora and leaf == "weight" else None
        if layer is None:
            return param.data
        delta = sum(layer.get_delta_weight(a).float() for a in layer.active_adapters if a in layer.lora_A)
        return (param.data.float() + delta).to(param.dtype)
