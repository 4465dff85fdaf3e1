"""Block scores for the sparse rows of a decode batch: ⟨mean of the GQA group's queries, landmark⟩.

Grid (rows = B·H_kv, chunks of `PB` blocks). Only candidate blocks [sink, n − recent) of rows whose
context exceeds their budget are scored: dense rows and reserved blocks are never ranked, so their scan
is skipped. Accumulation is float32 on CUDA cores (not `tl.dot`), so the scores equal the reference's
float32 scores up to summation order and the ranking is not perturbed by a bf16 rounding of the query.
`mean_int8` landmarks (`INT8`) are read as 16-byte aligned int8 rows and scaled after the dot product by the float32
scale after each row's D values (read through a float32 view): 144 bytes a row against a bfloat16 mean key's 256.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _score_kernel(
    q_ptr, lm_ptr, lm_scale_ptr, block_table_ptr, seq_len_ptr, budget_ptr, score_ptr,
    stride_qb, stride_qh, stride_bt, stride_sr,
    sink, recent, max_blocks,
    H: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BS: tl.constexpr, MINMAX: tl.constexpr, INT8: tl.constexpr, LM_W: tl.constexpr, PB: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    b = row // H
    h = row % H
    j = sink + chunk * PB + tl.arange(0, PB)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    # Issued together: nothing below waits for seq_len before its first memory access.
    phys = tl.load(block_table_ptr + b * stride_bt + j, mask=j < max_blocks, other=0).to(tl.int64)
    q = tl.load(q_ptr + b * stride_qb + (h * G + g[:, None]) * stride_qh + d[None, :],
                mask=(g[:, None] < G) & (d[None, :] < D), other=0.0)
    seq_len = tl.load(seq_len_ptr + b).to(tl.int32)
    budget = tl.maximum(tl.minimum(tl.load(budget_ptr + b), 1 << 30).to(tl.int32), sink + recent)
    n = (seq_len + BS - 1) // BS
    active = j < tl.where(n > budget, n - recent, 0)  # candidates of sparse rows only
    q_mean = tl.sum(q.to(tl.float32), axis=0) / G

    m = active[:, None] & (d[None, :] < D)
    if MINMAX:
        base = (phys * H + h) * (2 * D)
        kmax = tl.load(lm_ptr + base[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
        kmin = tl.load(lm_ptr + base[:, None] + D + d[None, :], mask=m, other=0.0).to(tl.float32)
        qe = q_mean[None, :]
        s = tl.sum(tl.maximum(qe * kmax, qe * kmin), axis=1)
    elif INT8:
        at = (phys * H + h) * LM_W  # each landmark row's first byte
        lm = tl.load(lm_ptr + at[:, None] + d[None, :], mask=m, other=0).to(tl.float32)
        scale = tl.load(lm_scale_ptr + at // 4 + D // 4, mask=active, other=0.0)
        s = tl.sum(lm * q_mean[None, :], axis=1) * scale
    else:
        base = (phys * H + h) * D
        lm = tl.load(lm_ptr + base[:, None] + d[None, :], mask=m, other=0.0).to(tl.float32)
        s = tl.sum(lm * q_mean[None, :], axis=1)
    tl.store(score_ptr + row * stride_sr + j, s, mask=active)


def score_blocks(
    q: torch.Tensor,
    landmarks: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    budgets: torch.Tensor,
    scores: torch.Tensor,
    *,
    block_size: int,
    sink: int,
    recent: int,
    mode: str,
) -> None:
    """Fill `scores: [B·H_kv, ≥M]` (float32) at the candidate blocks of sparse rows; other entries are left as they were."""
    bsz, num_q_heads, head_dim = q.shape
    num_kv_heads = landmarks.shape[1]
    group = num_q_heads // num_kv_heads
    max_blocks = block_tables.shape[1]
    minmax, int8 = mode == "minmax", mode == "mean_int8"
    pb = max(16, min(128, 16384 // (2 * head_dim if minmax else head_dim)))  # 32 KB of bf16 landmarks per program
    grid = (bsz * num_kv_heads, max(1, triton.cdiv(max_blocks - sink, pb)))
    _score_kernel[grid](
        q, landmarks, landmarks.view(torch.float32) if int8 else landmarks, block_tables, seq_lens, budgets, scores,
        q.stride(0), q.stride(1), block_tables.stride(0), scores.stride(0),
        sink, recent, max_blocks,
        H=num_kv_heads, G=group, BLOCK_G=triton.next_power_of_2(group), D=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BS=block_size, MINMAX=minmax, INT8=int8, LM_W=landmarks.shape[-1], PB=pb,
        num_warps=8,
    )
