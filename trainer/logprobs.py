"""Per-token statistics from the LM head in chunks: never the whole [tokens, vocab] logits at once.

For each position the logits are taken in float32, divided by the rollout temperature and
log-softmaxed over the full vocabulary (what the rollout engines report). With gradients, each chunk
runs under activation checkpointing, so only its input hidden states are kept for backward and the
vocabulary-sized tensors are recomputed; a 30K-token sequence then costs one chunk of logits at a time.
"""

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint


@dataclass
class TokenStats:
    logprobs: torch.Tensor
    """`[N]` log π(target) (carries gradient when asked)."""
    entropy: torch.Tensor
    """`[N]` entropy of the tempered distribution."""
    top_ids: torch.Tensor
    """`[N, K]` the K most likely tokens, descending."""
    top_logprobs: torch.Tensor


def _chunk_stats(hidden: torch.Tensor, targets: torch.Tensor, lm_head: torch.nn.Module, temperature: float, topk: int):
    logits = lm_head(hidden).float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(-1, targets[:, None])[:, 0]
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
        top_lp, top_ids = logp.topk(topk, dim=-1)
    return chosen, entropy, top_ids, top_lp


def token_stats(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    lm_head: torch.nn.Module,
    temperature: float,
    topk: int,
    chunk_tokens: int,
) -> TokenStats:
    """Statistics of `targets: [N]` given the final hidden states `hidden: [N, H]` that predict them."""
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"hidden has {hidden.shape[0]} positions but targets has {targets.shape[0]}")
    topk = min(topk, lm_head.out_features if hasattr(lm_head, "out_features") else topk)
    grad = torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, y = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if grad:
            parts.append(checkpoint(_chunk_stats, h, y, lm_head, temperature, topk, use_reentrant=False))
        else:
            parts.append(_chunk_stats(h, y, lm_head, temperature, topk))
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return TokenStats(empty, empty, targets.new_zeros(0, topk), hidden.new_zeros(0, topk, dtype=torch.float32))
    chosen, entropy, top_ids, top_lp = zip(*parts)
    return TokenStats(
        logprobs=torch.cat(chosen),
        entropy=torch.cat(entropy).detach(),
        top_ids=torch.cat(top_ids).detach(),
        top_logprobs=torch.cat(top_lp).detach(),
    )
