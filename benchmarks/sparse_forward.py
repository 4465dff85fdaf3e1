"""The trainer's sparse forward, one attention layer forward + backward: the reference (float32 einsum, keeps the
[H_q, T, T] logits) against `block_sparse_causal_sdpa` (what DistillSparse runs), at SmolLM2's head shape, with
dense causal SDPA (what the policy update runs) as the floor.

    python3 benchmarks/sparse_forward.py [--lengths 1024 2048 4096] [--device cpu|cuda] [--dtype float32|bfloat16]
"""

import argparse
import time

import torch

from sparrow.kernels import SparseAttentionConfig
from sparrow.kernels.reference import block_sparse_causal_attention, block_sparse_causal_sdpa, sdpa
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
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    config = SparseAttentionConfig(block_size=16, sink=1, recent=2)
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


if __name__ == "__main__":
    raise SystemExit(main())
