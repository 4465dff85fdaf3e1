"""The options of `sparrow bench kernels` (the CLI registers them). Triton-free, so the CLI builds its
parser anywhere; the benchmark itself (`measure.py`) is imported only when chosen."""

import sys
from pathlib import Path

from sparrow.layout import BLOCK_SIZE, KV_CACHE_DTYPES


def register(actions) -> None:
    """`sparrow bench kernels`: the Triton decode kernels' bandwidth (logic in `measure.py`)."""
    k = actions.add_parser("kernels", help="decode attention kernels: achieved bandwidth vs the copy bandwidth, beside "
                           "torch SDPA and FlashInfer when installed (CUDA)")
    k.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 8 64)")
    k.add_argument("--contexts", type=int, nargs="+", help="context lengths in tokens (default 8192 16384 32768)")
    k.add_argument("--budgets", type=int, nargs="+",
                   help=f"KV budgets in tokens, multiples of {BLOCK_SIZE} (default 1024 2048 4096)")
    k.add_argument("--groups", type=int, nargs="+", help="query heads per KV head (default 2 4)")
    k.add_argument("--minmax-contexts", type=int, nargs="*", help="contexts also timed with min/max landmarks (default 32768)")
    k.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
                   help="K/V pages: auto = bfloat16 (default); fp8_e4m3 = e4m3 with a float32 scale per vector (ours only)")
    k.add_argument("--no-sweep", action="store_true", help="skip the attention tiling / split-K sweep")
    k.add_argument("--rep-ms", type=int, help="do_bench time per measurement in ms (default 60)")
    k.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/kernels-<gpu>-<time>.json)")
    k.set_defaults(handler=run_kernels)


def run_kernels(args, command: str | None = None) -> int:
    from .measure import run_from_args

    run_from_args(args, command or "sparrow " + " ".join(sys.argv[1:]))
    return 0

