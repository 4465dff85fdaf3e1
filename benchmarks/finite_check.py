"""How long the NaN/inf check of a published policy takes on the CPU, where a rollout worker stages what it receives.

    python3 benchmarks/finite_check.py [--elements 500000000]

Prints one row per dtype: the elementwise `torch.isfinite(t).all()` the weight validation used before, and
`sparrow.finite.all_finite` (a sum, with the elementwise check only when the sum is not finite).
"""

import argparse
import time

import torch

from sparrow.finite import all_finite
from sparrow.tables import markdown_table


def _seconds(check, t: torch.Tensor) -> tuple[float, bool]:
    start = time.perf_counter()
    ok = check(t)
    return time.perf_counter() - start, ok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, default=500_000_000, help="weights checked per dtype (Qwen3-1.7B: 2.0e9)")
    args = p.parse_args(argv)
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        t = torch.randn(args.elements).to(dtype)
        gb = t.numel() * t.element_size() / 1e9
        old, ok_old = _seconds(lambda x: bool(torch.isfinite(x).all()), t)
        new, ok_new = _seconds(all_finite, t)
        assert ok_old and ok_new
        rows.append([str(dtype).removeprefix("torch."), f"{gb:.2f}", f"{old:.3f}", f"{gb / old:.2f}", f"{new:.3f}",
                     f"{gb / new:.1f}", f"{old / new:.0f}x"])
        del t
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads")
    print(markdown_table(["dtype", "GB", "isfinite().all() s", "GB/s", "all_finite s", "GB/s", "faster"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
