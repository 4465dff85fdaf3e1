"""A rank's checkpoints: saving and resuming the DeepSpeed engine with the step counter and DistillSparse's
optimizer, on this number of ranks or another.

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

from .collectives import all_gather_objects
from .lora import is_lora_param
from .policy import Policy

UNIVERSAL = "universal"
LORA_OPTIMIZER_FILE = "sparse_lora_optimizer.pt"


def save(policy: Policy, directory: str, tag: str, step_count: int, rank: int) -> None:
    """DeepSpeed checkpoint (model, optimizer, LR schedule, ZeRO partitions) plus the LoRA optimizer; collective."""
    policy.engine.save_checkpoint(directory, tag=tag, client_state={"step_count": step_count})
    if policy.lora is not None and rank == 0:
        lora = policy.lora
        state = {"optimizer": lora.optimizer.state_dict(), "scheduler": lora.scheduler.state_dict()}
        torch.save(state, Path(directory) / tag / LORA_OPTIMIZER_FILE)


def load(policy: Policy, directory: str, tag: str | None, rank: int, world_size: int) -> tuple[str, int]:
    """Resume from `save` (tag None = the latest one DeepSpeed recorded), saved by this many ranks or another
    (then through the universal checkpoint); the tag and the saved step counter. Collective."""
    latest = Path(directory) / "latest"
    if tag is None and not latest.is_file():
        raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory!r} (no 'latest' file); give a tag")
    tag = tag or latest.read_text().strip()
    path = Path(directory) / tag
    if not path.is_dir():
        raise FileNotFoundError(f"no DeepSpeed checkpoint {tag!r} under {directory!r}")
    saved = model_states(path)
    saved_ranks = int(saved["dp_world_size"])
    resized = saved_ranks != world_size
    if resized:
        _convert_once(path, saved_ranks, rank, world_size)
        _, client = load_universal(policy.engine, path)
    else:
        _, client = policy.engine.load_checkpoint(directory, tag=tag)
    if policy.lora is not None:
        if resized:  # the universal load restores what DeepSpeed optimises; the adapter is outside it
            params = dict(policy.engine.module.named_parameters())
            for name, t in saved["module"].items():
                if is_lora_param(name):
                    params[name].data.copy_(t)
        state = torch.load(path / LORA_OPTIMIZER_FILE)
        policy.lora.optimizer.load_state_dict(state["optimizer"])
        policy.lora.scheduler.load_state_dict(state["scheduler"])
    return tag, int(client.get("step_count", 0))


def _convert_once(path: Path, saved_ranks: int, rank: int, world_size: int) -> None:
    """Rank 0 converts; every rank waits for it and raises its error (a collective, so none hangs)."""
    error = None
    if rank == 0:
        try:
            convert_to_universal(path, saved_ranks, world_size)
        except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks heard of it
            error = e
    message = all_gather_objects(None if error is None else str(error))[0]
    if error is not None:
        raise error
    if message is not None:
        raise RuntimeError(message)


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
