"""Out-of-tree vLLM models: vLLM's own Qwen3 / Llama whose sparse layers use `SPARROW_SPARSE`.

The stock model is built first; then every attention layer outside `dense_layers` is rebuilt with
the same shapes and name but Sparrow's backend. Dense layers keep the backend vLLM picked for the
platform (FlashAttention on CUDA, CPU_ATTN on CPU), so they are vLLM's stock attention exactly.
Weights, loaders, LoRA and packed-module maps are inherited unchanged (no new parameters).
"""

from . import _vllm, runtime
from .backend import SparrowSparseBackend


def install_sparse_attention(model, vllm_config) -> list[int]:
    """Swap the attention of the sparse layers; returns their indices."""
    options = (vllm_config.additional_config or {}).get(runtime.OPTIONS_KEY)
    if options is None:
        raise ValueError(
            f"{type(model).__name__} needs additional_config['{runtime.OPTIONS_KEY}'] with the sparse-attention "
            "options (build the engine with sparrow.rollout_workers.vllm_backend.VllmEngine)"
        )
    state = runtime.configure(options)
    state.attention.check_layers(vllm_config.model_config.hf_config.num_hidden_layers)
    attention_cls = _vllm.Attention
    context = vllm_config.compilation_config.static_forward_context
    sparse = []
    for name, module in list(model.named_modules()):
        if type(module) is not attention_cls:
            continue
        index = _vllm.extract_layer_index(module.layer_name)
        if state.attention.is_dense_layer(index):
            continue
        parent_name, _, attr = name.rpartition(".")
        del context[module.layer_name]
        replacement = attention_cls(
            module.num_heads, module.head_size, module.impl.scale,
            num_kv_heads=module.num_kv_heads, cache_config=vllm_config.cache_config,
            quant_config=module.quant_config, per_layer_sliding_window=module.sliding_window,
            prefix=module.layer_name, attn_type=module.attn_type,
            attn_backend=SparrowSparseBackend, layer_index=index,
        )
        setattr(model.get_submodule(parent_name), attr, replacement)
        sparse.append(index)
    state.first_sparse_layer = min(sparse) if sparse else None
    state.prepare_counters(next(model.parameters()).device)
    return sparse


class SparrowQwen3ForCausalLM(_vllm.Qwen3ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self.sparse_layers = install_sparse_attention(self, vllm_config)


class SparrowLlamaForCausalLM(_vllm.LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self.sparse_layers = install_sparse_attention(self, vllm_config)
