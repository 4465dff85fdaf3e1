"""Batched sampling with per-row temperature, top-p, top-k and seed, and the logprobs a trainer recomputes.

Logprobs and top-k lists always come from the float32 log-softmax of `logits / T` over the whole
vocabulary, before top-p / top-k filtering; at T = 0 (greedy) they are the T = 1 log-softmax.
Randomness is counter-based: the exponential noise of row r comes from a generator seeded with a
hash of (seed_r, position_r). A sample therefore depends only on its own seed and position, never on
what else is in the batch, whether it was preempted and recomputed, or the step it ran in.

On CUDA, batches without top-p / top-k filtering (the RL rollout case) are sampled by one pass of a Triton
kernel over the logits (`sparrow.kernels.triton.sampling`: the same exponential race, its noise Philox keyed by
the same per-row seed), instead of the dozen passes and per-row noise launches below; the draws differ from the
eager sampler's on the same seed, the distribution and the logprobs do not.
"""

import functools
from dataclasses import dataclass

import torch

from sparrow.seeds import mix_seed

from .transfer import to_device

@dataclass
class SamplingBatch:
    """One row per sequence to sample, all tensors `[R]` on the logits' device."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    noise_seeds: list[int]
    """mix_seed(seed, position) per row."""
    num_logprobs: int
    any_random: bool
    any_filter: bool

    @classmethod
    def build(cls, params, seeds, positions, device) -> "SamplingBatch":
        """`params`: a SamplingParams per row; `seeds` 64-bit ints; `positions`: index of the token to draw."""
        device = torch.device(device)
        return cls(
            temperature=to_device([p.temperature for p in params], device, torch.float32),
            top_p=to_device([p.top_p for p in params], device, torch.float32),
            top_k=to_device([p.top_k for p in params], device, torch.long),
            noise_seeds=[mix_seed(s, p) for s, p in zip(seeds, positions)],
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
    finite: torch.Tensor  # [R] bool: the row's logits had no NaN or +inf


def exponential_noise(noise_seeds: list[int], vocab: int, device) -> torch.Tensor:
    """`[R, vocab]` Exp(1) draws as −log U (uniform_ is 5x faster than exponential_ on CPU); row r is
    a pure function of `noise_seeds[r]`."""
    gen = torch.Generator(device=device)
    out = torch.empty(len(noise_seeds), vocab, device=device)
    for row, seed in zip(out, noise_seeds):
        row.uniform_(generator=gen.manual_seed(seed))
    return out.log_().neg_()


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


def sample(logits: torch.Tensor, batch: SamplingBatch, fused: bool = True) -> SampleOutput:
    """Draw one token per row of float32 `logits: [R, V]`; `fused`: the Triton kernel where it applies."""
    if uses_fused_sampler(logits.device, fused) and not batch.any_filter:
        return sample_fused(logits, batch)
    return sample_eager(logits, batch)


def sample_eager(logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
    """The sampler in PyTorch ops: every filter, any device; the reference the fused kernel is tested against."""
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
        # Exponential race (= Gumbel-max): argmax_v p_v / E_v draws v with probability p_v.
        noise = exponential_noise(batch.noise_seeds, logits.shape[-1], logits.device)
        drawn = (candidates - noise.log()).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, drawn)
    top_logprobs, top_ids = logprobs.topk(min(batch.num_logprobs, logprobs.shape[-1]), dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0]
    # A NaN or +inf logit makes the whole row's log-softmax NaN, so the chosen entry tells.
    return SampleOutput(tokens=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs,
                        finite=torch.isfinite(chosen))


def uses_fused_sampler(device, fused: bool = True) -> bool:
    """Whether unfiltered batches on `device` take the Triton sampler: asked for, on CUDA, with Triton there."""
    return fused and torch.device(device).type == "cuda" and fused_sampling() is not None


@functools.cache
def fused_sampling():
    """`sparrow.kernels.triton.sampling`, or None without Triton (the eager sampler then runs on CUDA too)."""
    try:
        from sparrow.kernels.triton import sampling
    except ImportError:
        return None
    return sampling


def noise_seed_tensor(noise_seeds: list[int], device) -> torch.Tensor:
    """The unsigned 64-bit noise seeds as the int64 bit patterns the fused kernel keys Philox with."""
    return to_device([s - (1 << 64) if s >= 1 << 63 else s for s in noise_seeds], torch.device(device), torch.int64)


def sample_fused(logits: torch.Tensor, batch: SamplingBatch) -> SampleOutput:
    seeds = noise_seed_tensor(batch.noise_seeds, logits.device) if batch.any_random else None
    tokens, chosen, top_logprobs, top_ids, finite = fused_sampling().sample_fused(
        logits, batch.temperature, seeds, batch.num_logprobs)
    return SampleOutput(tokens=tokens, logprobs=chosen, top_ids=top_ids, top_logprobs=top_logprobs, finite=finite)
