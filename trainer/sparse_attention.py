"""The trainer's sparse-attention forward: Sparrow's block-sparse rule inside a Hugging Face model.

`register()` adds the attention function "sparrow_block_sparse" to transformers' AttentionInterface
(with the sdpa mask builder). A forward that passes `sparrow_sparse=SparseForward(...)` runs
`sparrow.kernels.reference.block_sparse_causal_sdpa_batch` in every layer outside `dense_layers`,
each query with the budget of its own context; any other forward (no such argument, or a dense
layer) is plain sdpa, so one loaded model serves both the dense policy and the sparse forward.

With FP8 KV pages (`kv_cache_dtype`) the engines' attention reads every K/V rounded through e4m3, so the sparse
forward (the rollout policy q) rounds them too, in every layer, dense layers included; the gradient passes the
rounding straight through (DistillSparse trains the adapter through it).

Budgets per query position are those of the rollout engines (`SparsitySchedule.query_budgets`): dense
at the prompt positions, the schedule's at context L = i + 1 after them. The prompts run SDPA's causal kernel,
only the response rows run under their mask (`[B, H, R, T]`, SDPA's memory-efficient kernel on a GPU): one call
per layer for all rows, whose operator count does not grow with the rows (a call per row cost ~3–4 ms of dispatch
per row and layer on an H100).
"""

from dataclasses import dataclass

import torch

from sparrow.kernels import SparseAttentionConfig
from sparrow.kernels.reference import SparseRows, block_sparse_causal_sdpa_batch, round_trip
from sparrow.layout import KVCacheDType
from sparrow.schedule import SparsitySchedule

from .microbatch import MicroBatch

ATTENTION_NAME = "sparrow_block_sparse"


@dataclass(frozen=True)
class SparseForward:
    """What one sparse forward needs: the selection rule, `[B, T]` total blocks per query and the rows' sparse
    queries (`SparseRows`), both on the model's device, and the engines' K/V pages; `of` builds one from host
    budgets."""

    config: SparseAttentionConfig
    budgets: torch.Tensor
    rows: SparseRows
    kv_cache_dtype: KVCacheDType = "auto"

    @classmethod
    def of(cls, config: SparseAttentionConfig, budgets: torch.Tensor, lengths: list[int],
           device: torch.device | str = "cpu", kv_cache_dtype: KVCacheDType = "auto") -> "SparseForward":
        """From host budgets `[B, T]` and each row's length before its right padding (prompt + response): the
        rows' sparse queries found here and everything moved to `device` once per forward, not once per layer,
        and without stalling the GPU to read anything back."""
        return cls(config, budgets.to(device), SparseRows.of(budgets, list(lengths), config, device), kv_cache_dtype)


def as_stored(x: torch.Tensor) -> torch.Tensor:
    """`x` as FP8 pages give it back (`round_trip`), with the gradient of `x` itself (straight through)."""
    plain = x.detach()
    return x + (round_trip(plain) - plain)  # no autograd graph through the rounding


def query_budgets(prompt_lens: list[int], seq_len: int, schedule: SparsitySchedule | list[SparsitySchedule]) -> torch.Tensor:
    """`[B, seq_len]` budgets of a padded batch: `schedule.query_budgets` per row (one schedule, or one per row)."""
    schedules = schedule if isinstance(schedule, list) else [schedule] * len(prompt_lens)
    if len(schedules) != len(prompt_lens):
        raise ValueError(f"{len(schedules)} schedules for {len(prompt_lens)} rows")
    return torch.stack([s.query_budgets(p, seq_len) for s, p in zip(schedules, prompt_lens)])


def micro_batch_forward(mb: MicroBatch, config: SparseAttentionConfig, schedule: SparsitySchedule | list[SparsitySchedule],
                        device: torch.device, kv_cache_dtype: KVCacheDType = "auto") -> SparseForward:
    """The sparse forward of a micro-batch under one schedule, or one schedule per row."""
    budgets = query_budgets(mb.prompt_lens, mb.input_ids.shape[1], schedule)
    lengths = [p + r for p, r in zip(mb.prompt_lens, mb.response_lens)]
    return SparseForward.of(config, budgets, lengths, device, kv_cache_dtype)


def sparrow_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sparrow_sparse=None, **kwargs):
    """HF attention function: `query [B, H_q, T, D]`, `key/value [B, H_kv, T, D]` → `[B, T, H_q, D]`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if sparrow_sparse is not None and sparrow_sparse.kv_cache_dtype != "auto":
        key, value = as_stored(key), as_stored(value)
    if sparrow_sparse is None or sparrow_sparse.config.is_dense_layer(module.layer_idx):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    budgets = sparrow_sparse.budgets
    expected = (query.shape[0], query.shape[2])
    if tuple(budgets.shape) != expected:
        raise ValueError(f"sparse budgets have shape {tuple(budgets.shape)}; expected [batch, seq] = {expected}")
    out = block_sparse_causal_sdpa_batch(query, key, value, budgets, sparrow_sparse.rows, sparrow_sparse.config, scaling)
    return out, None


def register() -> str:
    """Make "sparrow_block_sparse" a valid `attn_implementation` (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, sparrow_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME
