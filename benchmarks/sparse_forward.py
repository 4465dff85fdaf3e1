"""The trainer's sparse forward, one attention layer forward + backward: the reference (float32 einsum, keeps the
[H_q, T, T] logits) against `block_sparse_causal_sdpa` (the SDPA form), at SmolLM2's head shape, with dense causal
SDPA (what the policy update runs) as the floor. With `--rows N` (N > 1), a micro-batch of N rows: one row at a time
(the trainer's former path) against `block_sparse_causal_sdpa_batch` (one call per layer, what it runs now).

    python3 benchmarks/sparse_forward.py [--lengths 1024 2048 4096] [--rows N] [--device cpu|cuda] [--dtype float32|bfloat16]
"""

import argparse
import time

import torch

from sparrow.kernels import SparseAttentionConfig
from sparrow.kernels.reference import (
    SparseRows,
    block_sparse_causal_attention,
    block_sparse_causal_sdpa,
    block_sparse_causal_sdpa_batch,
    sdpa,
)
from sparrow.tables import markdown_table

HEADS_Q, HEADS_KV, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def _run(attention, inputs, budgets, config, device) -> tuple[float, float]:
    """Seconds for forward + backward, and peak GPU memory in GiB (0 on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = attention(*inputs, budgets, config)
    out.float().square().sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
    return time.perf_counter() - start, peak


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--budget", type=int, default=16, help="total blocks per query past the prompt")
    p.add_argument("--prompt", type=float, default=0.9, help="share of each sequence that is prompt (dense)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--rows", type=int, default=1, help="rows per call; > 1 compares one call per row with the batched call")
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = SparseAttentionConfig(block_size=16, sink=1, recent=2)
    if args.rows > 1:
        return _batched(args, device, dtype, config)
    rows = []
    for seq in args.lengths:
        gen = torch.Generator().manual_seed(seq)
        inputs = [torch.randn(seq, h, HEAD_DIM, generator=gen).to(device, dtype).requires_grad_()
                  for h in (HEADS_Q, HEADS_KV, HEADS_KV)]
        budgets = torch.where(torch.arange(seq) < int(args.prompt * seq), 10**9, args.budget).to(device)
        timings = {}
        dense = lambda q, k, v, budgets, config: sdpa(q, k, v, causal=True)  # noqa: E731
        for name, attention in (("reference", block_sparse_causal_attention), ("sdpa", block_sparse_causal_sdpa),
                                ("dense", dense)):
            runs = [_run(attention, inputs, budgets, config, device) for _ in range(args.repeats + 1)][1:]
            timings[name] = min(r[0] for r in runs), max(r[1] for r in runs)
        (ref_s, ref_gb), (new_s, new_gb), (dense_s, _) = timings["reference"], timings["sdpa"], timings["dense"]
        rows.append([str(seq), f"{ref_s:.3f}", f"{new_s:.3f}", f"{ref_s / new_s:.1f}x", f"{dense_s:.3f}",
                     f"{new_s / dense_s:.2f}"]
                    + ([f"{ref_gb:.2f}", f"{new_gb:.2f}"] if device.type == "cuda" else []))
    print(f"one layer, {HEADS_Q} query / {HEADS_KV} KV heads of {HEAD_DIM}, {args.dtype} on {device}, "
          f"budget {args.budget} blocks after a {args.prompt:.0%} prompt; forward + backward, best of {args.repeats}")
    headers = ["tokens", "reference s", "sdpa s", "faster", "dense causal s", "sdpa / dense"]
    if device.type == "cuda":
        headers += ["reference peak GiB", "sdpa peak GiB"]
    print(markdown_table(headers, rows))
    return 0


def _batched(args, device, dtype, config) -> int:
    """N rows of each length in SDPA's layout: a loop of single-row calls against one batched call, and dense."""
    rows = []
    for seq in args.lengths:
        gen = torch.Generator().manual_seed(seq)
        inputs = [torch.randn(args.rows, h, seq, HEAD_DIM, generator=gen).to(device, dtype).requires_grad_()
                  for h in (HEADS_Q, HEADS_KV, HEADS_KV)]
        host = torch.where(torch.arange(seq) < int(args.prompt * seq), 10**9, args.budget).expand(args.rows, seq)
        budgets = host.to(device)
        sparse_rows = SparseRows.of(host, [seq] * args.rows, config, device)
        one_row = SparseRows.of(host[:1], [seq], config, device)

        def per_row(q, k, v, budgets, config):
            return torch.stack([block_sparse_causal_sdpa(q[b].transpose(0, 1), k[b].transpose(0, 1), v[b].transpose(0, 1),
                                                         budgets[b], config, rows=one_row) for b in range(q.shape[0])])

        def batched(q, k, v, budgets, config):
            return block_sparse_causal_sdpa_batch(q, k, v, budgets, sparse_rows, config)

        def dense(q, k, v, budgets, config):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        timings = {}
        for name, attention in (("per row", per_row), ("batched", batched), ("dense", dense)):
            runs = [_run(attention, inputs, budgets, config, device) for _ in range(args.repeats + 1)][1:]
            timings[name] = min(r[0] for r in runs)
        rows.append([str(seq), f"{timings['per row']:.4f}", f"{timings['batched']:.4f}",
                     f"{timings['per row'] / timings['batched']:.1f}x", f"{timings['dense']:.4f}",
                     f"{timings['batched'] / timings['dense']:.2f}"])
    print(f"one layer, {args.rows} rows of {HEADS_Q} query / {HEADS_KV} KV heads of {HEAD_DIM}, {args.dtype} on {device}, "
          f"budget {args.budget} blocks after a {args.prompt:.0%} prompt; forward + backward, best of {args.repeats}")
    print(markdown_table(["tokens per row", "one call per row s", "batched s", "faster", "dense causal s",
                          "batched / dense"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
