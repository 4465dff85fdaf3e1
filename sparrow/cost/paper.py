"""Sparrow's closed-form decode cost, exactly as the paper prints it (Sec. 3.3 and App. F).

Symbols: P parameters, N samples per prompt, B prompts per batch (App. F), L_in prompt length,
L_out generated length, D the per-token K (or V) size over all layers, r = GQA ratio, K / `budget`
the KV budget in tokens, ps the block ("page") size, I the eFLOPs factor. Cost = compute + I · memory.

Units: the formulas are dimensionally consistent when D is read as *bytes* of K per token
(layers · kv_heads · head_dim · 2 for bf16): compute is then in FLOPs (2 per multiply-add; QK and
PV over c context tokens cost r·D_bytes·c each), memory in bytes (2P for bf16 weights, 2·D per
token for K+V), and I in FLOP/byte. The CLI evaluates them that way. They are continuous
approximations of per-step sums (Σ_t ctx ≈ L_out²/2); `rollout.py` sums the exact per-step costs.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class PaperCost:
    compute: float
    memory: float
    intensity: float

    @property
    def eflops(self) -> float:
        return self.compute + self.intensity * self.memory

    def __add__(self, other: "PaperCost") -> "PaperCost":
        if other.intensity != self.intensity:
            raise ValueError(f"cannot add costs priced at I={self.intensity} and I={other.intensity}")
        return PaperCost(self.compute + other.compute, self.memory + other.memory, self.intensity)


def sec33_dense(*, P: float, N: int, L_in: int, L_out: int, D: int, r: int, I: float) -> PaperCost:
    """Dense decode of N samples sharing one prompt's KV (read once per step for all samples)."""
    compute = 2 * P * N * L_out + r * (2 * L_in + L_out) * L_out * N * D
    memory = 2 * L_in * L_out * D + N * L_out**2 * D
    return PaperCost(compute, memory, I)


def sec33_scoring(
    *, N: int, L_in: int, L_out: int, D: int, r: int, I: float, page_size: int, prefix_over_ps: bool = True
) -> PaperCost:
    """Landmark scoring: one D-vector per block, scored every step.

    As printed, the prompt terms (2·N·L_in·D·L_out and 2·I·L_in·D·L_out) are not divided by ps
    although the prompt also has one landmark per ps tokens; that is read as a typo and divided by
    ps by default (`prefix_over_ps=True`). `prefix_over_ps=False` reproduces the printed formula.
    The other coefficients (2 rather than r in the compute prompt term, the prompt landmarks read
    once for all N samples) are kept as printed.
    """
    prefix_div = page_size if prefix_over_ps else 1
    compute = 2 * N * L_in * D * L_out / prefix_div + r * N * D * L_out**2 / (2 * page_size)
    memory = 2 * L_in * D * L_out / prefix_div + N * D * L_out**2 / (2 * page_size)
    return PaperCost(compute, memory, I)


def sec33_sparse(
    *, P: float, N: int, L_in: int, L_out: int, D: int, r: int, I: float, budget: int, page_size: int,
    prefix_over_ps: bool = True,
) -> PaperCost:
    """Block-sparse decode: every step reads `budget` tokens of K/V per sample, plus scoring."""
    attend = PaperCost(2 * N * P * L_out + 2 * r * N * D * budget * L_out, 2 * N * D * budget * L_out, I)
    return attend + sec33_scoring(
        N=N, L_in=L_in, L_out=L_out, D=D, r=r, I=I, page_size=page_size, prefix_over_ps=prefix_over_ps
    )


def appf_context_sum(L_in: int, L_out: int, K: float | None) -> float:
    """H(L_in, L_out, K) = (2·L_in + L_dense)·L_dense + 2K·(L_out − L_dense)_+, L_dense = min(L_out, K − L_in).

    Twice the K/V tokens read over the rollout: dense until the context reaches K, then K per step.
    K=None means dense throughout. When K < L_in the rollout is sparse from the first step
    (L_dense clamped at 0).
    """
    l_dense = L_out if K is None else max(0, min(L_out, K - L_in))
    sparse_part = 0 if K is None else 2 * K * max(0, L_out - l_dense)
    return (2 * L_in + l_dense) * l_dense + sparse_part


def appf_cost(
    *, P: float, B: int, N: int, L_in: int, L_out: int, D: int, r: int, I: float, K: float | None = None
) -> PaperCost:
    """App. F: B prompts × N samples, weight traffic included, no prefix sharing; dense when K is None."""
    h = appf_context_sum(L_in, L_out, K)
    return PaperCost(2 * P * B * N * L_out + r * B * N * D * h, 2 * P * L_out + B * N * D * h, I)
