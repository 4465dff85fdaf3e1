"""The vLLM backend's prompt-row attention (`paged_prefill_attention`) on a GPU, one layer of one row prefilled in
2,048-token chunks, against the call it made before (a boolean mask with `enable_gqa`, which SDPA can only run in
its math kernel) on the same pages: milliseconds per row and layer, and the largest |difference| of the outputs.

    python3 -m sparrow.bench.vllm_prefill [--contexts 2048 8192 24832] [--device cuda] [--out FILE]

Needs no vLLM: the function reads Sparrow blocks out of a page tensor laid out as vLLM's pages are. On a GPU each
call is the median of CUDA-event timings with L2 flushed; `--device cpu` (fp32, wall clock) checks the bench itself.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from sparrow.layout import BLOCK_SIZE
from sparrow.rollout_workers.vllm_backend.paged_kv import paged_prefill_attention
from sparrow.tables import format_table

from .cuda_timing import median_us
from .result_files import default_out_path

CHUNK = 2048
SHAPE = {"q_heads": 16, "kv_heads": 8, "head_dim": 128}  # a Qwen3-1.7B layer


def masked_gqa(query, k_blocks, v_blocks, block_table, query_spans, seq_lens, scale, out) -> None:
    """The call `paged_prefill_attention` made until 2026-12-06: the baseline."""
    num_kv_heads, head_dim = k_blocks.shape[1], k_blocks.shape[3]
    for row, ((start, end), seq_len) in enumerate(zip(query_spans, seq_lens)):
        ids = block_table[row, : (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE].long()
        keys = k_blocks[ids].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :seq_len]
        values = v_blocks[ids].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :seq_len]
        pos_q = torch.arange(seq_len - (end - start), seq_len, device=query.device)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= pos_q[:, None]
        q = query[start:end].transpose(0, 1)
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = attended.transpose(0, 1).to(out.dtype)


def row_prefill(fn, query, k_blocks, v_blocks, table, context: int, out) -> None:
    """One row's whole prompt, chunk by chunk, as vLLM's chunked prefill hands it to the layer."""
    for start in range(0, context, CHUNK):
        end = min(start + CHUNK, context)
        fn(query[start:end], k_blocks, v_blocks, table, [(0, end - start)], [end], query.shape[-1] ** -0.5,
           out[start:end])


def wall_ms(fn, reps: int = 5) -> float:
    """Median wall-clock milliseconds of `fn` on the CPU."""
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(context: int, device: str = "cuda") -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(context)
    blocks = -(-context // BLOCK_SIZE)
    kv_shape = (blocks + 7, SHAPE["kv_heads"], BLOCK_SIZE, SHAPE["head_dim"])
    k_blocks = torch.randn(kv_shape, device=device, dtype=dtype, generator=gen)
    v_blocks = torch.randn(kv_shape, device=device, dtype=dtype, generator=gen)
    table = torch.randperm(blocks + 7, device=device, generator=gen)[None, :blocks].int()
    query = torch.randn(context, SHAPE["q_heads"], SHAPE["head_dim"], device=device, dtype=dtype, generator=gen)
    outs = {name: torch.empty_like(query) for name in ("now", "before")}
    fns = {"now": paged_prefill_attention, "before": masked_gqa}
    ms = {}
    for name, fn in fns.items():
        call = lambda f=fn, o=outs[name]: row_prefill(f, query, k_blocks, v_blocks, table, context, o)  # noqa: E731
        ms[name] = median_us(call, rep_ms=300) / 1e3 if device == "cuda" else wall_ms(call)
    diff = (outs["now"].float() - outs["before"].float()).abs().max().item()
    return {"context": context, "ms_now": ms["now"], "ms_before": ms["before"], "speedup": ms["before"] / ms["now"],
            "max_abs_diff": diff}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 24832])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    rows = []
    for context in args.contexts:
        rows.append(measure(context, args.device))
        print(f"[vllm-prefill] {context} tokens done", flush=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    dtype = "bf16" if args.device == "cuda" else "fp32"
    print(f"paged_prefill_attention, one row and one layer ({SHAPE}, {dtype}, {CHUNK}-token chunks) on {name}")
    print(format_table(["context", "ms now", "ms before", "before / now", "max |diff|"],
                       [[r["context"], f"{r['ms_now']:.2f}", f"{r['ms_before']:.2f}", f"{r['speedup']:.1f}x",
                         f"{r['max_abs_diff']:.1e}"] for r in rows]))
    out = args.out or default_out_path(name, "vllm-prefill")
    out.write_text(json.dumps({"kind": "vllm-prefill", "device_name": name, "shape": SHAPE, "chunk": CHUNK,
                               "rows": rows}, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
