"""`sparrow export RUN_DIR [--step N] --out DIR [--overwrite] [--max-shard-size SIZE]`: a run's DeepSpeed
checkpoint as a Hugging Face model directory (docs/trainer.md, "Checkpoints and export")."""

import time
from pathlib import Path


def configure(p) -> None:
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a `sparrow train` run directory")
    p.add_argument("--step", type=int, help="the checkpoint of this step (default: the latest)")
    p.add_argument("--out", type=Path, required=True, help="output directory (new or empty)")
    p.add_argument("--overwrite", action="store_true", help="replace --out when it holds an earlier export")
    p.add_argument("--max-shard-size", default=None, metavar="SIZE", help="largest safetensors file, e.g. 2GB (default 5GB)")
    p.set_defaults(handler=run)


def run(args) -> int:
    from sparrow.cli.main import CliError
    from sparrow.coordinator.config import read_trainer_config
    from sparrow.coordinator.run_dir import RunDir
    from sparrow.trainer.hf_export import DEFAULT_MAX_SHARD_SIZE, check_out, export_checkpoint

    run_dir = RunDir(args.run_dir)
    if not run_dir.config_file.is_file():
        raise CliError(f"{args.run_dir}: not a run directory (no config.yaml)")
    tag = run_dir.checkpoint_tag(args.step)
    trainer = read_trainer_config(run_dir.config_file)
    if not (Path(trainer.model) / "config.json").is_file():
        raise CliError(
            f"model directory {trainer.model} (the run's trainer model, from {run_dir.config_file}) is gone; the export "
            "takes the config and tokenizer from it: restore it (the default model: sparrow fetch-model smollm2)"
        )
    try:
        check_out(args.out, args.overwrite)
    except FileExistsError as exc:
        hint = "" if args.overwrite else "; choose a new or empty directory, or pass --overwrite to replace an earlier export"
        raise CliError(f"--out {exc}{hint}") from None
    start = time.perf_counter()
    written = export_checkpoint(run_dir.checkpoints, tag, trainer.model, trainer.distill_sparse, args.out,
                                args.overwrite, args.max_shard_size or DEFAULT_MAX_SHARD_SIZE)
    shards = [f for f in written["files"] if f.endswith(".safetensors") and "/" not in f]
    ranks = f"{written['ranks']} rank{'s' if written['ranks'] != 1 else ''}"
    print(f"{run_dir.path} {tag} (ZeRO-{written['zero_stage']}, {ranks}) → {written['policy']}: "
          f"{len(shards)} safetensors file(s), {written['bytes'] / 2**20:.1f} MiB {written['dtype']}, "
          f"tokenizer of {trainer.model}, in {time.perf_counter() - start:.1f} s")
    if written["sparse_lora"]:
        print(f"DistillSparse adapter (not merged into the policy) → {written['sparse_lora']}")
    return 0
