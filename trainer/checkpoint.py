"""A DeepSpeed checkpoint's saved state, and resuming it on another number of ranks.

ZeRO writes one optimizer partition per data-parallel rank, and DeepSpeed's ordinary loader accepts
only the world size that saved them. For another size, rank 0 converts `DIR/TAG` once into
DeepSpeed's universal checkpoint (every parameter's fp32 weights and Adam moments whole, plus the
LR schedule and client state) under `DIR/TAG/universal/`, so it is pruned with the checkpoint, and
every rank cuts its new partition from that.
"""

import argparse
import shutil
from pathlib import Path

import torch

UNIVERSAL = "universal"


def model_states(path: str | Path) -> dict:
    """The first model-states file under `path` (one checkpoint tag), memory-mapped: `dp_world_size`
    (the ranks that saved it), `ds_config` and `module` (the weights, read only when touched)."""
    from deepspeed.utils.zero_to_fp32 import get_model_state_files

    return torch.load(get_model_state_files(str(path))[0], map_location="cpu", mmap=True, weights_only=False)


def convert_to_universal(path: Path, saved: int, current: int) -> None:
    """`path/universal` from `path`, unless an earlier resume made it (it appears whole, by a rename)."""
    out = path / UNIVERSAL
    if out.is_dir():
        return
    from deepspeed.checkpoint.ds_to_universal import main

    partial = path / f"{UNIVERSAL}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    args = argparse.Namespace(
        input_folder=str(path), output_folder=str(partial), num_extract_workers=1, num_merge_workers=1,
        keep_temp_folder=False, strict=True, inject_missing_state=True,  # plain DeepSpeed saves no UC metadata
    )
    try:
        found = len(list(path.glob("*optim_states.pt")))
        if found != saved:  # ds_to_universal counts ranks by files: a missing one would be silently dropped
            raise FileNotFoundError(f"{found} optimizer partition files (*optim_states.pt) for {saved} ranks")
        main(args)
    except Exception as e:
        shutil.rmtree(partial, ignore_errors=True)
        raise RuntimeError(
            f"checkpoint {path} was saved by {saved} trainer ranks and could not be converted to DeepSpeed's "
            f"universal format to resume on {current}: {type(e).__name__}: {e}. Resume with "
            f"trainer.pool.size={saved}, or convert it yourself with DeepSpeed's ds_to_universal.py "
            f"(--input_folder {path} --output_folder {out} --inject_missing_state)"
        ) from e
    (path / "latest_universal").unlink(missing_ok=True)  # ds_to_universal's pointer, to the .partial name
    partial.rename(out)


def load_universal(engine, path: Path) -> tuple:
    """`engine.load_checkpoint` of `path/universal`. DeepSpeed reads its `checkpoint.load_universal`
    flag only inside load_checkpoint, so it is on for this call alone: later loads stay ordinary."""
    engine._config.load_universal_checkpoint = True
    try:
        return engine.load_checkpoint(str(path), tag=UNIVERSAL)
    finally:
        engine._config.load_universal_checkpoint = False
