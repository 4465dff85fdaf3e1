"""The tensor-parallel engine's all-reduce at decode sizes: NCCL (what `TensorParallel.all_reduce` runs) against
PyTorch's symmetric-memory one-shot and two-shot all-reduce, two GPUs.

A decode step of the 2-way engine runs two all-reduces a layer of `[batch, hidden]` bf16 (72 a step for the 36-layer
Qwen3-4B/8B shapes), captured in its CUDA graph. Each variant is timed as a CUDA graph of 72 back-to-back all-reduces,
median of 20 replays, µs per all-reduce; the symmetric-memory variants are timed with and without the copy into their
symmetric buffer (the engine would have its projection write there). Results are checked against NCCL's.
Prints a table last (rank 0); `--out` writes the rows as JSON.

Usage (two CUDA GPUs, repo root): python benchmarks/allreduce_tp.py [--out FILE]
"""

import argparse
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparrow.tables import format_table

SHAPES = {"qwen3-8b b40": (40, 4096), "qwen3-4b b40": (40, 2560), "qwen3-8b b8": (8, 4096), "qwen3-1.7b b32": (32, 2048)}
CALLS, REPLAYS = 72, 20


def _time(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    times = []
    for _ in range(REPLAYS):
        dist.barrier()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return sorted(times)[REPLAYS // 2]


def _rank(rank: int, world: int, workdir: str, out: str | None) -> None:
    from torch.distributed import _symmetric_memory as symm_mem

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{workdir}/rendezvous", rank=rank, world_size=world)
    group = dist.group.WORLD
    ops = torch.ops.symm_mem
    rows = []
    for name, (m, hidden) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(rank)
        x = torch.randn(m, hidden, device="cuda", generator=gen).bfloat16()
        expect = x.clone()
        dist.all_reduce(expect)
        nccl_buf = x.clone()
        symm = symm_mem.empty(m, hidden, dtype=torch.bfloat16, device="cuda")
        symm_mem.rendezvous(symm, group.group_name)
        out_buf = torch.empty_like(x)

        def one_shot():
            return ops.one_shot_all_reduce_out(symm, "sum", group.group_name, out_buf)

        def two_shot():
            return ops.two_shot_all_reduce_(symm, "sum", group.group_name)

        variants = {  # label: (what is timed, the symmetric-memory reduction whose result is checked)
            "nccl": (lambda: dist.all_reduce(nccl_buf), None),
            "symm one-shot": (one_shot, one_shot),
            "symm one-shot + copy in": (lambda: (symm.copy_(x), one_shot()), one_shot),
            "symm two-shot + copy in": (lambda: (symm.copy_(x), two_shot()), two_shot),
        }
        for label, (fn, reduce) in variants.items():
            try:
                us = _time(fn)
                err = None
                if reduce is not None:
                    symm.copy_(x)
                    err = (reduce().float() - expect.float()).abs().max().item()
            except Exception as exc:  # an op this torch lacks is reported, not fatal
                if rank == 0:
                    print(f"{name} {label}: {exc!r}"[:300], file=sys.stderr, flush=True)
                continue
            rows.append({"shape": name, "rows": m, "hidden": hidden, "variant": label, "us": round(us, 2),
                         "max_abs_diff_vs_nccl": err})
            if rank == 0:
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    if rank == 0:
        if out:
            with open(out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
        print(format_table(["shape", "variant", "us per all-reduce", "max |diff| vs NCCL"],
                           [[r["shape"], r["variant"], f"{r['us']:.2f}",
                             "-" if r["max_abs_diff_vs_nccl"] is None else f"{r['max_abs_diff_vs_nccl']:.3g}"]
                            for r in rows]))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        raise SystemExit("allreduce_tp.py needs two CUDA GPUs")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory(prefix="sparrow-allreduce-") as workdir:
        mp.start_processes(_rank, args=(2, workdir, args.out), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
