"""What every GPU engine benchmark shares: paper anchors, the device record, the output file."""

import datetime
import json
import sys
from pathlib import Path

import torch

from sparrow.bench.result_files import default_out_path as results_path

DEVICE, DTYPE = "cuda", torch.bfloat16
PAPER_STEP_MS = {16384: 4.59, 24576: 5.13, 32768: 5.41}
"""Sparrow Table 4: full decode step, one H200, batch 8, 1024-token budget (16 × 64-token pages)."""
PAPER_ROLLOUT_SPEEDUP = {"qwen3-1.7b": 2.21, "qwen3-4b": 2.41, "qwen3-8b": 2.06}
"""Sparrow: rollout throughput sparse/dense at the 0.86 schedules, 4×H200, 32K generation, AIME × 8."""
TARGET_OVER_PAPER = 1.25


def bench_command(action: str) -> str:
    """The `sparrow bench ACTION ...` line that repeats this run, whether it came from the CLI or `python -m`."""
    args = sys.argv[sys.argv.index(action):] if action in sys.argv else [action, *sys.argv[1:]]
    return "sparrow bench " + " ".join(args)


def device_report(command: str) -> dict:
    import triton

    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "num_sms": props.multi_processor_count,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command, "torch": torch.__version__, "triton": triton.__version__}


def default_out_path(kind: str) -> Path:
    return results_path(torch.cuda.get_device_properties(0).name, kind)


def write_report(report: dict, out_path: Path | None, log) -> None:
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(report, indent=1))
        log(f"wrote {out_path}")


def require_cuda(what: str) -> None:
    if not torch.cuda.is_available():
        raise ValueError(f"sparrow bench {what} needs a CUDA GPU (CUDA graphs and the Triton kernels)")
