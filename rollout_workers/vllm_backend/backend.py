"""`SPARROW_SPARSE`: Sparrow's block-sparse decode attention as a vLLM attention backend.

Only the sparse layers use it (the model classes in `models.py` pick it per layer); dense layers
keep vLLM's stock backend. In a sparse layer:

- the KV write stores keys and values in the Sparrow layout (`paged_kv`) and maintains the block
  landmarks in a side table of `[num_pages·m, H_kv, W]` per layer, sized from the KV budget the
  engine reserved for it;
- decode rows (one generated token, prompt done) attend to `budget(L)` blocks per KV head, with
  `budget` from the worker's current schedule and L = the row's total length, through a
  `sparrow.kernels` backend (torch reference on CPU, Triton on CUDA);
- prompt rows (prefill, chunked prefill, prefix-cache extends) attend densely, as in Sparrow.

With `cuda_graphs: full_decode` the builder declares `UNIFORM_SINGLE_TOKEN_DECODE`: a decode-only step replays one
graph of the whole model. What the sparse layers read is then at fixed addresses, refilled before each replay:
vLLM's own seq_lens, block table and slot mapping (views of its persistent buffers; a page is one Sparrow block) and
the builder's budgets buffer; the padding rows of a graph (no query token, length 0) attend nothing. The Triton
kernels' scratch is allocated before capture, and per-step counting happens on the host when metadata is built.
"""

from dataclasses import dataclass

import torch

from sparrow.layout import BLOCK_SIZE

from . import _vllm, runtime
from .paged_kv import paged_prefill_attention, sparse_block_table, sparse_block_views


@dataclass
class SparrowMetadata:
    """One engine step of one KV-cache group, shared by all its sparse layers."""

    num_actual_tokens: int
    num_live_decodes: int
    """Decode rows that are requests (a full graph's padding rows, no query token and length 0, are not)."""
    decode_tokens: slice | torch.Tensor
    """Query rows of the decode rows: a slice when they lead the batch, else their indices."""
    decode_block_table: torch.Tensor
    """Sparrow block table of the decode rows `[num_decodes, pages·m]`."""
    decode_seq_lens: torch.Tensor
    budgets: torch.Tensor | None
    """Decode rows' budgets (None = dense)."""
    slot_mapping: torch.Tensor
    prefill_block_table: torch.Tensor
    prefill_query_spans: list[tuple[int, int]]
    prefill_seq_lens: list[int]

    @property
    def num_decodes(self) -> int:
        return self.decode_seq_lens.shape[0]


class SparrowMetadataBuilder(_vllm.AttentionMetadataBuilder[SparrowMetadata]):
    _cudagraph_support = _vllm.AttentionCGSupport.NEVER

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec):
        """Eager layers inside vLLM's piecewise graphs, unless the engine asked for full decode graphs."""
        options = (vllm_config.additional_config or {}).get(runtime.OPTIONS_KEY) or {}
        if options.get("full_decode_graphs"):
            return _vllm.AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.page_size = kv_cache_spec.block_size
        self._init_reorder_batch_threshold(1)
        state = runtime.current()
        model, scheduler = vllm_config.model_config, vllm_config.scheduler_config
        max_rows = max(scheduler.max_num_seqs, vllm_config.compilation_config.max_cudagraph_capture_size or 0)
        self.budgets = torch.zeros(max_rows, dtype=torch.long, device=device)
        """The decode rows' budgets, refilled in place each step (the address a decode graph captured)."""
        if state.full_decode_graphs:  # on CUDA, pages of BLOCK_SIZE (VllmEngineConfig): the scratch before capture
            width = -(-model.max_model_len // BLOCK_SIZE)
            width = -(-width // BLOCK_TABLE_ALIGN) * BLOCK_TABLE_ALIGN
            parallel = vllm_config.parallel_config
            state.backend(torch.device(device)).prepare(
                max_rows, width, model.get_num_attention_heads(parallel), model.get_num_kv_heads(parallel),
                model.get_head_size(), device)

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False) -> SparrowMetadata:
        md = step_metadata(common_attn_metadata, self.page_size, self.budgets)
        if md.num_live_decodes:
            runtime.current().count_decode_step(md.num_live_decodes)
        return md

    def build_for_cudagraph_capture(self, common_attn_metadata) -> SparrowMetadata:
        """A dummy decode batch: its metadata, with no step counted."""
        return step_metadata(common_attn_metadata, self.page_size, self.budgets)


BLOCK_TABLE_ALIGN = 128 // BLOCK_SIZE
"""vLLM rounds its block tables' width up to a multiple of 128 / page size (kernels that read 128-token tiles)."""


def step_metadata(cm, page_size: int, budgets_out: torch.Tensor | None = None) -> SparrowMetadata:
    """Split one step's rows (vLLM's `CommonAttentionMetadata`) into sparse decodes and dense prompt rows; the
    decodes' budgets go into `budgets_out` (the builder's buffer) when given."""
    rows = cm.num_reqs
    padding = _vllm.padding_rows(cm)
    decoding = _vllm.decode_rows(cm, padding)
    decode_rows = decoding.nonzero().flatten()
    prefill_rows = (~decoding).nonzero().flatten()
    num_decodes = decode_rows.numel()
    starts = cm.query_start_loc_cpu[: rows + 1]
    device = cm.seq_lens.device
    block_table = sparse_block_table(cm.block_table_tensor[:rows], page_size)
    seq_lens = cm.seq_lens[:rows]
    if bool(decoding[:num_decodes].all()):  # decodes lead (always with the V1 runner): row i is query token i
        decode_tokens = decode_index = slice(0, num_decodes)
    else:
        decode_index = decode_rows.to(device, non_blocking=True)
        decode_tokens = starts[decode_rows].long().to(device, non_blocking=True)
    decode_seq_lens = seq_lens[decode_index]
    prefill = prefill_rows.tolist()
    prefill_seq_lens = []
    if prefill:  # read on the host only for prompt rows (an older runner's seq_lens.cpu() waits for the GPU)
        seq_lens_cpu = cm.seq_lens_cpu_upper_bound if cm.seq_lens_cpu_upper_bound is not None else cm.seq_lens.cpu()
        prefill_seq_lens = seq_lens_cpu[prefill_rows].tolist()
    out = None if budgets_out is None else budgets_out[:num_decodes]
    return SparrowMetadata(
        num_actual_tokens=cm.num_actual_tokens,
        num_live_decodes=num_decodes - padding,
        decode_tokens=decode_tokens,
        decode_block_table=block_table[decode_index],
        decode_seq_lens=decode_seq_lens,
        budgets=runtime.current().budgets(decode_seq_lens, block_table.shape[1], out) if num_decodes else None,
        slot_mapping=cm.slot_mapping,
        prefill_block_table=block_table[prefill_rows.to(device, non_blocking=True)] if prefill else block_table[:0],
        prefill_query_spans=[(int(starts[r]), int(starts[r + 1])) for r in prefill],
        prefill_seq_lens=prefill_seq_lens,
    )


class SparrowSparseImpl(_vllm.AttentionImpl):
    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes, sliding_window, kv_cache_dtype,
                 logits_soft_cap=None, attn_type=None, kv_sharing_target_layer_name=None, layer_index: int = -1):
        unsupported = {
            "alibi_slopes": alibi_slopes, "sliding_window": sliding_window, "logits_soft_cap": logits_soft_cap,
            "kv_sharing_target_layer_name": kv_sharing_target_layer_name,
        }
        given = {k: v for k, v in unsupported.items() if v is not None}
        if given:
            raise ValueError(f"Sparrow sparse attention (layer {layer_index}) does not support {given}")
        if attn_type not in (None, _vllm.AttentionType.DECODER):
            raise ValueError(f"Sparrow sparse attention (layer {layer_index}) is decoder-only, got attn_type={attn_type!r}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.layer_index = layer_index
        self.landmarks: torch.Tensor | None = None

    def _landmarks(self, k_blocks: torch.Tensor, state: runtime.SparseRuntime) -> torch.Tensor:
        """The side table, allocated once the KV pages exist (its bytes come out of the KV budget)."""
        num_blocks = k_blocks.shape[0]
        if self.landmarks is None or self.landmarks.shape[0] != num_blocks:
            width = state.attention.landmark_width(self.head_size)
            self.landmarks = torch.zeros(num_blocks, self.num_kv_heads, width, dtype=k_blocks.dtype, device=k_blocks.device)
            state.landmark_bytes += self.landmarks.numel() * self.landmarks.element_size()
        return self.landmarks

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        state = runtime.current()
        k_blocks, v_blocks = sparse_block_views(kv_cache)
        landmarks = self._landmarks(k_blocks, state)
        num = slot_mapping.shape[0]
        key, value = key[:num], value[:num]
        backend = state.backend(kv_cache.device)
        if backend.name == "reference":  # the Triton write skips padding slots (-1) itself, without a host sync
            live = slot_mapping >= 0
            if not bool(live.all()):
                slot_mapping, key, value = slot_mapping[live], key[live], value[live]
        backend.write_kv(k_blocks, v_blocks, landmarks, slot_mapping, key, value, state.attention)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("Sparrow sparse attention has no fused output quantization")
        if attn_metadata is None:
            return output
        md: SparrowMetadata = attn_metadata
        state = runtime.current()
        k_blocks, v_blocks = sparse_block_views(kv_cache)
        if md.num_decodes:
            backend = state.backend(kv_cache.device)
            q, landmarks = query[md.decode_tokens], self._landmarks(k_blocks, state)
            out, blocks = backend.decode(
                q, k_blocks, v_blocks, landmarks, md.decode_block_table, md.decode_seq_lens, md.budgets,
                state.attention, self.scale,
            )
            output[md.decode_tokens] = out
            if self.layer_index == state.first_sparse_layer:
                state.record_step(md.decode_seq_lens, blocks)
            state.trace_choice(self.layer_index, q, landmarks, md.decode_block_table, md.decode_seq_lens, md.budgets)
        if md.prefill_seq_lens:
            paged_prefill_attention(
                query, k_blocks, v_blocks, md.prefill_block_table, md.prefill_query_spans, md.prefill_seq_lens,
                self.scale, output,
            )
            if self.layer_index == state.first_sparse_layer:
                state.record_prompt(md.prefill_query_spans)
        return output


class SparrowSparseBackend(_vllm.KVCacheDeclaration, _vllm.AttentionBackend):
    forward_includes_kv_cache_update = False
    supported_dtypes = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes = ["auto"]

    @staticmethod
    def get_name() -> str:
        return _vllm.surface().backend_name

    @staticmethod
    def get_impl_cls():
        return SparrowSparseImpl

    @staticmethod
    def get_builder_cls():
        return SparrowMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None):
        return [_vllm.MultipleOf(BLOCK_SIZE)]
