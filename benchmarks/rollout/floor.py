"""The bytes a decode step must move, and the speedup if dense and sparse both ran at that floor."""

from sparrow.kernels import SparseAttentionConfig
from sparrow.kernels.reference import vector_bytes
from sparrow.rollout_workers.native.model import DecoderModel
from sparrow.rollout_workers.native.model_spec import ModelSpec
from sparrow.schedule import SparsitySchedule

from .common import DTYPE


def weight_bytes(model: DecoderModel) -> int:
    """Parameters read per decode step: all of them, except an untied embedding (only B rows are read)."""
    total = sum(p.numel() for p in model.parameters())
    if model.lm_head is not None:
        total -= model.model.embed_tokens.weight.numel()
    return total * model.dtype.itemsize


def step_bytes(model: DecoderModel, attention: SparseAttentionConfig, batch: int, context: int,
               budget_blocks: int | None, kv_cache_dtype: str = "auto") -> dict:
    """Bytes one decode step must move at `context` tokens per sequence (the new one included):
    weights, K/V of dense layers, and in sparse layers the attended K/V (partial block by its valid
    tokens; FP8 pages: one byte an element and a 4-byte scale a vector), the candidates' landmarks and
    their fp32 scores (written once, read once)."""
    spec, item = model.spec, model.dtype.itemsize
    bs = attention.block_size
    kv_tok = 2 * spec.num_kv_heads * vector_bytes(spec.head_dim, model.dtype, kv_cache_dtype)  # K, V: a token, a layer
    n = attention.blocks_for(context)
    dense_layers = sum(1 for i in range(spec.num_layers) if attention.is_dense_layer(i))
    sparse_layers = spec.num_layers - dense_layers
    out = {"weights": weight_bytes(model), "dense_kv": dense_layers * batch * context * kv_tok}
    if budget_blocks is None or n <= budget_blocks:
        out.update(sparse_kv=sparse_layers * batch * context * kv_tok, landmarks=0, scores=0)
    else:
        attended = (budget_blocks - 1) * bs + context - (n - 1) * bs
        candidates = n - attention.sink - attention.recent
        out.update(sparse_kv=sparse_layers * batch * attended * kv_tok,
                   landmarks=sparse_layers * batch * candidates * spec.num_kv_heads
                   * attention.landmark_bytes(spec.head_dim, item),
                   scores=sparse_layers * batch * candidates * spec.num_kv_heads * 8)
    out["total"] = sum(out.values())
    return out


def byte_floor_speedup(spec: ModelSpec, schedule: SparsitySchedule, attention: SparseAttentionConfig, batch: int, lo: int,
                       hi: int, kv_cache_dtype: str = "auto") -> float:
    """Σ dense bytes / Σ sparse bytes of the decode steps at contexts lo..hi (every block-size-th one), K/V in
    `kv_cache_dtype` pages: the protocol's speedup if both modes ran at the memory floor. A measured speedup reaches
    it when sparse runs as close to its floor as dense does, and passes it only when dense runs further from its
    floor than sparse."""
    model = DecoderModel(spec, attention.block_size, device="meta", dtype=DTYPE)
    dense = sparse = 0
    for context in range(lo, hi + 1, attention.block_size):
        dense += step_bytes(model, attention, batch, context, None, kv_cache_dtype)["total"]
        sparse += step_bytes(model, attention, batch, context, schedule.blocks_attended(context), kv_cache_dtype)["total"]
    return dense / sparse
