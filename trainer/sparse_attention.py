"""The trainer's sparse-attention forward: Sparrow's block-sparse rule inside a Hugging Face model.

`register()` adds the attention function "sparrow_block_sparse" to transformers' AttentionInterface
(with the sdpa mask builder). A forward that passes `sparrow_sparse=SparseForward(...)` runs
`sparrow.kernels.reference.block_sparse_causal_sdpa` in every layer outside `dense_layers`,
each query with the budget of its own context; any other forward (no such argument, or a dense
layer) is plain sdpa, so one loaded model serves both the dense policy and the sparse forward.

Budgets per query position are those of the rollout engines (`SparsitySchedule.query_budgets`): dense
at the prompt positions, the schedule's at context L = i + 1 after them. The prompt rows run SDPA's causal
kernel; only the response rows are masked (`[H_kv, R, T]`, SDPA's memory-efficient kernel on a GPU), and a row's
right padding is not attended at all (zeros: nothing reads it), so the sparse forward costs about what the dense
one does.
"""

from dataclasses import dataclass

import torch
from torch.nn import functional as F

from sparrow.kernels import SparseAttentionConfig
from sparrow.kernels.reference import block_sparse_causal_sdpa, first_sparse_query
from sparrow.schedule import SparsitySchedule

ATTENTION_NAME = "sparrow_block_sparse"


@dataclass(frozen=True)
class SparseForward:
    """What one sparse forward needs: the selection rule and `[B, T]` total blocks per query (on the model's
    device), and per row its length and first sparse query, found on the host (`of` builds one)."""

    config: SparseAttentionConfig
    budgets: torch.Tensor
    lengths: list[int]
    """Tokens of each row before its right padding (prompt + response)."""
    firsts: list[int]
    """Each row's `first_sparse_query`: the positions before it attend densely."""

    @classmethod
    def of(cls, config: SparseAttentionConfig, budgets: torch.Tensor, lengths: list[int],
           device: torch.device | str = "cpu") -> "SparseForward":
        """From host budgets `[B, T]`: the rows' first sparse queries found here, the budgets moved to `device`
        once per forward (not once per layer, and without stalling the GPU to read them back)."""
        host = budgets.cpu()
        if len(lengths) != host.shape[0] or (lengths and max(lengths) > host.shape[1]):
            raise ValueError(f"sparse row lengths {lengths} do not fit a batch of {host.shape[0]} rows "
                             f"of {host.shape[1]} positions")
        firsts = [first_sparse_query(host[b, :n], config) for b, n in enumerate(lengths)]
        return cls(config, budgets.to(device), list(lengths), firsts)


def query_budgets(prompt_lens: list[int], seq_len: int, schedule: SparsitySchedule | list[SparsitySchedule]) -> torch.Tensor:
    """`[B, seq_len]` budgets of a padded batch: `schedule.query_budgets` per row (one schedule, or one per row)."""
    schedules = schedule if isinstance(schedule, list) else [schedule] * len(prompt_lens)
    if len(schedules) != len(prompt_lens):
        raise ValueError(f"{len(schedules)} schedules for {len(prompt_lens)} rows")
    return torch.stack([s.query_budgets(p, seq_len) for s, p in zip(schedules, prompt_lens)])


def sparrow_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sparrow_sparse=None, **kwargs):
    """HF attention function: `query [B, H_q, T, D]`, `key/value [B, H_kv, T, D]` → `[B, T, H_q, D]`."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if sparrow_sparse is None or sparrow_sparse.config.is_dense_layer(module.layer_idx):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    budgets = sparrow_sparse.budgets
    expected = (query.shape[0], query.shape[2])
    if tuple(budgets.shape) != expected:
        raise ValueError(f"sparse budgets have shape {tuple(budgets.shape)}; expected [batch, seq] = {expected}")
    rows = []
    for b, (n, first) in enumerate(zip(sparrow_sparse.lengths, sparrow_sparse.firsts)):
        row = block_sparse_causal_sdpa(
            query[b, :, :n].transpose(0, 1), key[b, :, :n].transpose(0, 1), value[b, :, :n].transpose(0, 1),
            budgets[b, :n], sparrow_sparse.config, scaling, first,
        )
        rows.append(F.pad(row, (0, 0, 0, 0, 0, expected[1] - n)))
    return torch.stack(rows), None


def register() -> str:
    """Make "sparrow_block_sparse" a valid `attn_implementation` (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, sparrow_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME
