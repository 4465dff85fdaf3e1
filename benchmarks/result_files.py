"""Where a GPU benchmark writes its JSON unless `--out` says otherwise: one naming for all of them."""

import datetime
from pathlib import Path

RESULTS_DIR = Path("benchmarks/results")


def default_out_path(device_name: str, kind: str) -> Path:
    """benchmarks/results/<kind>-<device>-<UTC time>.json, the naming every GPU benchmark uses."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    slug = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    return RESULTS_DIR / f"{kind}-{slug}-{stamp}.json"
