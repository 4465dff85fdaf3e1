"""Batched sampling with per-row temperature, top-p, top-k and seed, and the logprobs a trainer recomputes.

Logprobs and top-k lists always come from the float32 log-softmax of `logits / T` over the whole
vocabulary, before top-p / top-k filtering; at T = 0 (greedy) they are the T = 1 log-softmax.
Randomness is counter-based: row r's Gumbel noise for token v is a hash of (seed_r, position_r, v).
A sample therefore depends only on its own seed and position, never on what else is in the batch,
whether it was preempted and recomputed, or the step it ran in — and there is no generator state.
"""

from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
    """One row per sequence to sample, all tensors `[R]` on the logits' device."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    seeds: torch.Tensor
    positions: torch.Tensor
    num_logprobs: int
    any_random: bool
    any_filter: bool

    @classmethod
    def build(cls, params, seeds, positions, device) -> "SamplingBatch":
        """`params`: a SamplingParams per row; `seeds` 64-bit ints; `positions`: index of the token to draw."""
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            seeds=torch.tensor([s % (1 << 63) for s in seeds], dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            num_logprobs=max((p.logprobs for p in params), default=0),
            any_random=any(p.temperature > 0 for p in params),
            any_filter=any(p.temperature > 0 and (p.top_p < 1 or p.top_k > 0) for p in params),
        )


@dataclass
class SampleOutput:
    tokens: torch.Tensor  # [R] long
    logprobs: torch.Tensor  # [R] float32, log q(sampled token)
    top_ids: torch.Tensor  # [R, K] long
    top_logprobs: torch.Tensor  # [R, K] float32
    finite: torch.Tensor  # [R] bool: logits had no NaN/inf


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x · c) mod 2^32 for 0 ≤ x < 2^32, in int64 without overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser: every input bit flips each output bit with probability ~1/2."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[R, vocab]` float64 uniforms in (0, 1), a pure function of (seed, position, token id)."""
    s = _fmix32((seeds & MASK32) ^ _fmix32((seeds >> 32) & MASK32))
    row = _fmix32(s ^ _mul32(positions & MASK32, 0x9E3779B1))
    token = _mul32(torch.arange(vocab, device=seeds.device), 0x27D4EB2F)
    h = _fmix32(row[:, None] ^ token[None, :])
    return (h.double() + 0.5) / 2.0**32


def filter_mask(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Boolean `[R, V]` of tokens kept by top-k (0 = off), then top-p over the renormalised rest."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device)
    k = torch.where(top_k > 0, top_k, vocab)
    keep = rank[None, :] < k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    keep &= mass_before < top_p[:, None]
    keep[:, 0] = True
    return torch.zeros_like(keep).scatter_(-1, order, keep)


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
    """Draw one token per row of float32 `logits: [R, V]`."""
    logits = logits.float()
    greedy = batch.temperature == 0
    temperature = torch.where(greedy, 1.0, batch.temperature)
    scaled = logits / temperature[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = logits.argmax(dim=-1)
    if batch.any_random:
        candidates = scaled
        if batch.any_filter:
            candidates = scaled.masked_fill(~filter_mask(scaled, batch.top_k, batch.top_p), float("-inf"))
        gumbel = -torch.log(-torch.log(uniform_noise(batch.seeds, batch.positions, logits.shape[-1])))
        drawn = (candidates.double() + gumbel).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, drawn)
    top_logprobs, top_ids = logprobs.topk(batch.num_logprobs, dim=-1) if batch.num_logprobs else (
        logprobs[:, :0], torch.zeros_like(tokens)[:, None][:, :0]
    )
    return SampleOutput(
        tokens=tokens,
        logprobs=logprobs.gather(-1, tokens[:, None])[:, 0],
        top_ids=top_ids,
        top_logprobs=top_logprobs,
        finite=torch.isfinite(logits).all(dim=-1),
    )
