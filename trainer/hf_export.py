"""The dense policy as a Hugging Face model directory, from live trainer ranks (`export_live`, behind
`TrainerRank.export_hf`) or from a DeepSpeed checkpoint (`export_checkpoint`, behind `sparrow export`):

    OUT/config.json, generation_config.json    the source model's (dtype = the weights')
    OUT/model.safetensors, or model-0000k-of-0000n.safetensors + model.safetensors.index.json
    OUT/tokenizer.json, tokenizer_config.json, chat_template.jinja, …   the source model's tokenizer
    OUT/sparse_lora/                           DistillSparse only: the adapter in peft format, not merged

Everything is written by the libraries' own `save_pretrained`. The model object is a shell built on
the meta device from the *source* directory's config and handed the tensors (checked key for key,
not copied): so the config is the source's rather than the trainer's live one (use_cache off, the
sparse attention function), and building it by class rather than through `from_config` keeps
transformers from partitioning it under a live ZeRO-3 config. The directory is written next to OUT
and renamed into place, so OUT is at any moment absent, the previous export, or complete.
"""

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from sparrow.weight_sync import plan_buckets

from .checkpoint import model_states
from .config import DistillSparseConfig, TrainerConfig
from .lora import adapter_state, attach_lora, clean_name
from .policy import Policy

DEFAULT_MAX_SHARD_SIZE = "5GB"


def check_out(out: Path, replace: bool) -> None:
    """OUT must be new or empty; with `replace`, an earlier export (never any other directory)."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return
    if not replace:
        raise FileExistsError(f"{out} exists and is not empty")
    if not (out / "config.json").is_file():
        raise FileExistsError(f"{out} is not an earlier export (no config.json); refusing to replace it")


def _load(model: torch.nn.Module, state: dict[str, torch.Tensor], what: str, keys) -> None:
    """Put `state` into `model` (assign: no copy), refusing missing or unexpected keys among `keys`."""
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = sorted(set(missing) & keys)
    if missing or unexpected:
        raise ValueError(
            f"{what} does not match {type(model).__name__}: missing {missing[:5]} ({len(missing)}), "
            f"unexpected {sorted(unexpected)[:5]} ({len(unexpected)}); was it trained from this model directory?"
        )


def _shell(model_dir: str):
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)](config)
    if (Path(model_dir) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(model_dir)
    return model


def write_hf_dir(
    state: dict[str, torch.Tensor],
    model_dir: str,
    out: str | Path,
    adapter: dict[str, torch.Tensor] | None = None,
    distill: DistillSparseConfig | None = None,
    replace: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> dict:
    """Write OUT from the policy's tensors (adapter-free HF names, tied weights once or twice) and, when
    given, the DistillSparse adapter's (peft names, `adapter_state`), whose LoRA config is `distill`."""
    from transformers import AutoTokenizer

    out = Path(out)
    check_out(out, replace)
    model = _shell(model_dir)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    _load(model, state, "the policy's state dict", set(model.state_dict()) - tied)
    model.tie_weights()
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, max_shard_size=max_shard_size)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(partial)
    if adapter:
        peft_model = attach_lora(model, distill)
        _load(peft_model, adapter, "the sparse LoRA adapter", set(adapter_state(peft_model.named_parameters())))
        peft_model.peft_config["default"].base_model_name_or_path = str(out)
        peft_model.save_pretrained(partial / "sparse_lora", save_embedding_layers=False)
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        partial.rename(out)
        shutil.rmtree(old)
    else:
        partial.rename(out)
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    return {
        "policy": str(out),
        "files": files,
        "bytes": sum((out / f).stat().st_size for f in files if f.endswith(".safetensors") and "/" not in f),
        "dtype": str(model.dtype).removeprefix("torch."),
        "sparse_lora": str(out / "sparse_lora") if adapter else None,
    }


def export_live(policy: Policy, config: TrainerConfig, rank: int, out: str | Path, replace: bool = False,
                max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE) -> dict:
    """`write_hf_dir` from the ranks' current weights, adapter unmerged. Collective under ZeRO-3 (every rank
    gathers, bucket by bucket as publication does); rank 0 holds the full policy in CPU memory and writes, and
    returns what it wrote ({} elsewhere)."""
    state = {}
    buckets = plan_buckets(policy.exporter.specs(), int(config.publish.bucket_mb * 2**20))
    for bucket in buckets:
        with policy.exporter.tensors([e.name for e in bucket.entries], merge_lora=False) as tensors:
            if rank == 0:
                state.update({n: t.detach().cpu().clone() for n, t in tensors.items()})
    if rank != 0:
        return {}
    start = time.perf_counter()
    adapter = None
    if policy.lora is not None:
        adapter = {n: t.detach().cpu().clone() for n, t in adapter_state(policy.engine.module.named_parameters()).items()}
    written = write_hf_dir(state, config.model, out, adapter, config.distill_sparse, replace, max_shard_size)
    return {**written, "seconds": time.perf_counter() - start}


@dataclass
class CheckpointPolicy:
    """The policy in a DeepSpeed checkpoint: adapter-free HF names, in the dtype the trainer ran."""

    state: dict[str, torch.Tensor]
    dtype: torch.dtype
    zero_stage: int
    ranks: int
    adapter: dict[str, torch.Tensor] = field(default_factory=dict)


def read_checkpoint(checkpoint_dir: str | Path, tag: str) -> CheckpointPolicy:
    """`checkpoint_dir/tag` as written by `TrainerRank.save_checkpoint`, any ZeRO stage and rank count.

    The weights are DeepSpeed's own consolidation of the fp32 master partitions (zero_to_fp32),
    cast to the training dtype (its saved DeepSpeed config: bf16 on GPU, float32 on CPU), which is
    what the ranks hold after the optimizer step. The DistillSparse adapter is replicated (ZeRO ≤ 2)
    and trained outside DeepSpeed's optimizer, so it is read from the module state instead.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    saved = model_states(Path(checkpoint_dir) / tag)
    ds_config = saved["ds_config"]
    dtype = torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else torch.float32
    fp32 = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag, exclude_frozen_parameters=True)
    return CheckpointPolicy(
        state={clean_name(k): v.to(dtype) for k, v in fp32.items()},
        dtype=dtype,
        zero_stage=int(ds_config["zero_optimization"]["stage"]),
        ranks=int(saved["dp_world_size"]),
        adapter={k: v.clone() for k, v in adapter_state(saved["module"].items()).items()},
    )


def export_checkpoint(
    checkpoint_dir: str | Path, tag: str, model_dir: str, distill: DistillSparseConfig, out: str | Path,
    replace: bool = False, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
) -> dict:
    """`read_checkpoint` then `write_hf_dir`: the same directory the live ranks' `export_hf` writes."""
    check_out(Path(out), replace)  # before the (long) consolidation
    policy = read_checkpoint(checkpoint_dir, tag)
    written = write_hf_dir(policy.state, model_dir, out, policy.adapter, distill, replace, max_shard_size)
    return {**written, "zero_stage": policy.zero_stage, "ranks": policy.ranks}
