"""Entry point of the `sparrow` console script."""

import argparse
import importlib
import sys

SUBCOMMANDS = [
    "sparrow.cli.schedule_cmd",
    "sparrow.cli.fetch_model_cmd",
    "sparrow.cli.cost_cmd",
    "sparrow.cli.generate_cmd",
    "sparrow.cli.bench_cmd",
    "sparrow.cli.train_cmd",
    "sparrow.cli.calibrate_cmd",
    "sparrow.cli.export_cmd",
]


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparrow",
        description="Sparse-attention rollouts for long-context RL, held at a target tail acceptance rate.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (CliError, ValueError, FileNotFoundError) as exc:
        print(f"sparrow {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
