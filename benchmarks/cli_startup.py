"""Wall-clock start-up of `sparrow` commands that do no real work, and whether each one loads torch.

    python benchmarks/cli_startup.py [--runs 9] [--out FILE.json]

Each command runs `--runs` times as a fresh process through the installed console script (the median
and the fastest run are reported; the machine may be shared, so the median is the number to quote, next
to the load average printed with it), then once more to see whether torch ended up in `sys.modules`.
The first row is the bare interpreter, the floor no command can go below. A command that exits non-zero
(e.g. `--version` on a Sparrow without it) is timed all the same and marked.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from sparrow.tables import format_table

COMMANDS = [
    ["--help"],
    ["--version"],
    ["schedule", "list"],
    ["schedule", "show", "qwen3-4b-0.86"],
    ["train", "--help"],
    ["generate", "--help"],
    ["calibrate", "--help"],
    ["fetch-model", "--help"],
    ["cost", "--help"],
    ["bench", "--help"],
]

LOADS_TORCH = """
import contextlib, io, sys
from sparrow.cli.main import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
print("torch" in sys.modules)
"""


def timed(argv: list[str], runs: int) -> dict:
    times, codes = [], set()
    for _ in range(runs):
        start = time.perf_counter()
        codes.add(subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode)
        times.append(time.perf_counter() - start)
    return {"times": times, "median_s": statistics.median(times), "min_s": min(times), "exit": max(codes)}


def loads_torch(args: list[str]) -> bool:
    out = subprocess.run([sys.executable, "-c", LOADS_TORCH, *args], check=True, capture_output=True, text=True)
    return out.stdout.strip() == "True"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=9, help="fresh processes per command (default 9)")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()
    script = Path(sys.executable).with_name("sparrow")
    if not script.exists():
        raise SystemExit(f"no console script at {script}: install Sparrow into this interpreter's environment")

    load_before = os.getloadavg()[0]
    results = [{"command": "python -c pass", **timed([sys.executable, "-c", "pass"], args.runs), "torch": False}]
    for command in COMMANDS:
        results.append({"command": "sparrow " + " ".join(command), **timed([str(script), *command], args.runs),
                        "torch": loads_torch(command)})
    load = (load_before, os.getloadavg()[0])

    print(f"sparrow start-up, {args.runs} runs per command, Python {platform.python_version()}, "
          f"{platform.machine()}, {os.cpu_count()} CPUs, 1-min load average {load[0]:.1f} at start, {load[1]:.1f} at end")
    rows = [[r["command"], f"{r['median_s']:.3f}", f"{r['min_s']:.3f}", "yes" if r["torch"] else "no",
             "ok" if r["exit"] == 0 else f"exit {r['exit']}"] for r in results]
    print(format_table(["command", "median s", "min s", "loads torch", "status"], rows))
    if args.out:
        args.out.write_text(json.dumps({"runs": args.runs, "load_average": load, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
