"""The recorded 32K-protocol runs re-read on their wall clocks (issue 14, 2026-11-29).

Until 2026-11-29 `bench rollout` timed each decode step as the `engine.step()` call alone. With overlapped decode the GPU
runs step t + 1 while the host is outside that call, so the host's time there (the loop's own bookkeeping: an
`engine.stats()` that scanned every KV block, ~0.3-0.9 ms a step at 16,000-66,000 blocks) was missing from the step
times, and whole runs reported the engine's busy clock, which misses it as well. Since then the loop times every step
from the end of the one before, so the steps add up to the wall clock (`real_run.real_rollout`).

This script re-reads the earlier records on their wall clocks. Each measured file gets the ratio of its wall clock to
its step-timed profile: a whole run's `wall_s - prefill_seconds`; a segment run in the same process as others
(`--segments K`, whose prefill is not recorded) from its progress lines (seconds since its requests at every 512th
step), over the windows between its first and last line. The joined profile's windows are scaled by the ratio of
the file (or segment) they came from. Records made after the change are read as they are (ratio 1).

    python benchmarks/wall_clock_recheck.py [--results benchmarks/results]
"""

import argparse
import json
import re
from pathlib import Path

from sparrow.bench.rollout.real_run import profile_seconds

WINDOW = 512
"""Decode steps per step-profile window and between progress lines in the records read here."""
PROGRESS = re.compile(r"^\s*(\w+): (\d+)/(\d+) decode steps, ([\d.]+) s$")

RECORDS = [
    # label, folder, the JSON each mode is read from (one name: both modes)
    ("1.7B b8, eager sampler (2026-11-27)", "rollout-protocol-nvidia-h200x4-20261127", "rollout-qwen3-1.7b-b8.json"),
    ("1.7B b32, eager sampler (2026-11-27)", "rollout-protocol-nvidia-h200x4-20261127", "rollout-qwen3-1.7b-b32.json"),
    ("1.7B b8, fused sampler (2026-11-29)", "rollout-protocol-nvidia-h200-20261129-1.7b-b8-fused-sampler",
     "rollout-qwen3-1.7b-b8.json"),
    ("1.7B b8, fused sampler, whole-loop timing (2026-11-29)", "rollout-protocol-nvidia-h200-20261129-wall-clock",
     "rollout-qwen3-1.7b-b8.json"),
    ("4B b24 (2026-11-27)", "rollout-protocol-nvidia-h200x4-20261127", "rollout-qwen3-4b-b24.json"),
    ("4B b24, committed split rule (2026-11-28)", "rollout-protocol-nvidia-h200x4-20261128", "rollout-qwen3-4b-b24.json"),
    ("4B b24, fused sampler (2026-11-29)", "rollout-protocol-nvidia-h200-20261129-4b-b24-fused-sampler",
     "rollout-qwen3-4b-b24.json"),
    ("4B b24, fused sampler, sparse with whole-loop timing (2026-11-29)", "rollout-protocol-nvidia-h200-20261129-wall-clock",
     {"dense": "../rollout-protocol-nvidia-h200-20261129-4b-b24-fused-sampler/rollout-qwen3-4b-b24.json",
      "sparse": "rollout-qwen3-4b-b24-sparse.json"}),
    ("8B b16 (2026-11-27)", "rollout-protocol-nvidia-h200x4-20261127", "rollout-qwen3-8b-b16.json"),
    ("8B b16, committed split rule (2026-11-28)", "rollout-protocol-nvidia-h200x4-20261128b", "rollout-qwen3-8b-b16.json"),
    ("8B b24, eager sampler (2026-11-28)", "rollout-protocol-nvidia-h200-20261128-8b-b24", "rollout-qwen3-8b-b24.json"),
    ("8B b24, fused sampler (2026-11-29)", "rollout-protocol-nvidia-h200-20261129-8b-b24-fused-sampler",
     "rollout-qwen3-8b-b24.json"),
    ("8B FP8 b40, before the wave step (2026-11-28)", "rollout-protocol-nvidia-h200-20261128-fp8",
     "rollout-qwen3-8b-fp8-b40.json"),
    ("8B FP8 b40, committed split rule (2026-11-28)", "rollout-protocol-nvidia-h200x4-20261128",
     "rollout-qwen3-8b-fp8-b40.json"),
    ("4B FP8 b40, committed split rule (2026-11-28)", "rollout-protocol-nvidia-h200x4-20261128",
     "rollout-qwen3-4b-fp8-b40.json"),
    ("8B tensor-parallel 2 b40, NCCL (2026-11-28)", "rollout-tp2-nvidia-h200x4-20261128", "rollout-tp2-qwen3-8b-b40.json"),
    ("4B tensor-parallel 2 b40, NCCL (2026-11-28)", "rollout-tp2-nvidia-h200x4-20261128", "rollout-tp2-qwen3-4b-b40.json"),
    ("8B tensor-parallel 2 b40, symmetric memory (2026-11-28)", "rollout-tp2-symm-nvidia-h200x4-20261128",
     "rollout-tp2-qwen3-8b-b40.json"),
    ("4B tensor-parallel 2 b40, symmetric memory (2026-11-28)", "rollout-tp2-symm-nvidia-h200x4-20261128",
     "rollout-tp2-qwen3-4b-b40.json"),
    ("8B b8, H100 (2026-11-28)", "rollout-protocol-nvidia-h100-20261128", "rollout-qwen3-8b-bf16-b8.json"),
]


def whole_file_ratio(result: dict) -> float:
    """Wall clock over step-timed profile for one measured run (1 for a run timed by the whole loop)."""
    if "decode_reads" in result:
        return 1.0
    return (result["wall_s"] - result["prefill_seconds"]) / profile_seconds(result["step_profile"])


def progress_ratio(log: Path, mode: str, start: int, windows: list[dict]) -> float:
    """A segment's wall clock over its step-timed windows between its first and last progress line."""
    lines = [PROGRESS.match(line) for line in log.read_text().splitlines()]
    points = sorted((int(m[2]) - start, float(m[4])) for m in lines
                    if m and m[1] == mode and start < int(m[2]) <= start + len(windows) * WINDOW)
    (first_done, first_s), (last_done, last_s) = points[0], points[-1]
    between = windows[first_done // WINDOW:last_done // WINDOW]
    return (last_s - first_s) / profile_seconds(between)


def mode_wall_clock(path: Path, mode: str) -> tuple[float, float, str]:
    """(seconds as reported, wall-clock seconds, method) of one mode of a record."""
    joined = json.loads(path.read_text())["modes"][mode]
    reported = joined["decode_seconds"]
    windows = joined["step_profile"]
    segments = joined.get("segments")
    if "decode_reads" in joined:
        return reported, reported, "whole loop"
    if not segments:
        return reported, profile_seconds(windows) * whole_file_ratio(joined), "wall_s"
    wall, methods, k = 0.0, set(), 0
    for seg in segments:
        part = windows[k // WINDOW:(k + seg["steps"] + WINDOW - 1) // WINDOW]
        k += seg["steps"]
        source = path.parent / Path(seg["file"]).name
        if source.suffix == ".json" and source.exists():
            ratio, method = whole_file_ratio(json.loads(source.read_text())["modes"][mode]), "wall_s"
        else:  # a segment of an in-process --segments run: its own progress lines
            log = path.with_name(path.name.replace(".json", f"-{mode}.log"))
            ratio, method = progress_ratio(log, mode, seg["start_step"], part), "progress"
        wall += profile_seconds(part) * ratio
        methods.add(method)
    return reported, wall, "+".join(sorted(methods))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=str(Path(__file__).parent / "results"))
    root = Path(parser.parse_args().results)
    print("| run | dense decode s: reported / wall clock | sparse decode s: reported / wall clock | sparse / dense: "
          "reported | **wall clock** | method |")
    print("|---|---|---|---|---|---|")
    for label, folder, files in RECORDS:
        files = files if isinstance(files, dict) else {"dense": files, "sparse": files}
        cells = {m: mode_wall_clock(root / folder / files[m], m) for m in ("dense", "sparse")}
        (d_step, d_wall, d_how), (s_step, s_wall, s_how) = cells["dense"], cells["sparse"]
        how = d_how if d_how == s_how else f"dense {d_how}, sparse {s_how}"
        print(f"| {label} | {d_step:.1f} / {d_wall:.1f} | {s_step:.1f} / {s_wall:.1f} | {d_step / s_step:.2f}x | "
              f"**{d_wall / s_wall:.2f}x** | {how} |")


if __name__ == "__main__":
    main()
