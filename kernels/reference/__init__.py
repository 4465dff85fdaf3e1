"""Pure-PyTorch reference of Sparrow's block-sparse decode attention (CPU and GPU).

Every faster backend (Triton kernels, the vLLM plugin) is tested against these functions.
"""

from .attention import dense_block_ids, paged_decode_attention
from .causal import (
    SparseRows,
    block_sparse_causal_attention,
    block_sparse_causal_sdpa,
    block_sparse_causal_sdpa_batch,
    causal_rows_mask,
    first_sparse_query,
    sdpa,
    sparse_causal_mask,
    sparse_rows_mask,
)
from .kv_quant import (
    FP8_KV_DTYPE,
    KVScales,
    dequantize,
    page_dtype,
    quantize,
    read_pages,
    round_trip,
    vector_bytes,
)
from .landmarks import (
    check_landmark_dtype,
    decode_landmarks,
    encode_mean,
    landmark_dtype,
    landmarks_from_keys,
    mean_keys,
    store_pages,
    update_landmarks,
    write_kv,
)
from .scoring import group_mean_queries, score_landmarks, score_paged_blocks
from .selection import choice_margin, chosen_candidates, select_blocks, selected_blocks_mask
from .sparse_decode import block_sparse_decode

__all__ = [
    "FP8_KV_DTYPE",
    "KVScales",
    "SparseRows",
    "block_sparse_causal_attention",
    "block_sparse_causal_sdpa",
    "block_sparse_causal_sdpa_batch",
    "first_sparse_query",
    "block_sparse_decode",
    "check_landmark_dtype",
    "choice_margin",
    "chosen_candidates",
    "decode_landmarks",
    "dense_block_ids",
    "dequantize",
    "encode_mean",
    "group_mean_queries",
    "landmark_dtype",
    "landmarks_from_keys",
    "mean_keys",
    "page_dtype",
    "paged_decode_attention",
    "quantize",
    "read_pages",
    "round_trip",
    "score_landmarks",
    "score_paged_blocks",
    "sdpa",
    "select_blocks",
    "selected_blocks_mask",
    "sparse_causal_mask",
    "sparse_rows_mask",
    "vector_bytes",
    "store_pages",
    "update_landmarks",
    "write_kv",
]
