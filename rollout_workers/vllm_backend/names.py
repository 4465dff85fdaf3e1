"""Names vLLM knows Sparrow's pieces by (import-free, so the plugin and the engine front end can use them)."""

PACKAGE = "sparrow.rollout_workers.vllm_backend"

BACKEND_NAME = "SPARROW_SPARSE"
"""Attention backend of the sparse layers (an `AttentionBackendEnum` member once registered; vLLM < 0.32 registers
it as `CUSTOM`, see `_vllm.Surface.backend_name`)."""

SPARSE_ARCHITECTURES = {
    "Qwen3ForCausalLM": "SparrowQwen3ForCausalLM",
    "LlamaForCausalLM": "SparrowLlamaForCausalLM",
}
"""Stock architecture → its Sparrow twin (selected with hf_overrides={'architectures': [twin]})."""

WORKER_EXTENSION = f"{PACKAGE}.worker_extension.SparrowWorkerExtension"
