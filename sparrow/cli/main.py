"""Entry point of the `sparrow` console script.

Only the module of the subcommand being run is imported (each has `configure(parser)`), and the
modules import torch, Ray and DeepSpeed inside their handlers: `sparrow --help`, `--version` and
`sparrow schedule ...` start without loading torch (benchmarks/cli_startup.py measures it).
"""

import argparse
import importlib
import sys

# name -> (module with configure(parser), the one-line help `sparrow --help` lists); `bench` is the benchmark wing's
# (benchmarks/, installed as sparrow.bench), which no product package imports.
SUBCOMMANDS = {
    "schedule": ("sparrow.cli.schedule_cmd", "inspect sparsity schedules (KV budget per length bin)"),
    "fetch-model": ("sparrow.cli.fetch_model_cmd", "materialise a real pretrained model without a model hub"),
    "cost": ("sparrow.cli.cost_cmd",
             "predicted decode cost and speedup of a sparsity schedule (paper forms + per-step sum)"),
    "generate": ("sparrow.cli.generate_cmd", "generate with the native engine (dense or block-sparse decode)"),
    "bench": ("sparrow.bench.cli",
              "benchmarks: rollout throughput, decode step, decode kernel bandwidth, trainer step, weight publication"),
    "train": ("sparrow.cli.train_cmd",
              "run a GRPO job: rollout pool, trainer pool, controller (embedded default without --config)"),
    "calibrate": ("sparrow.cli.calibrate_cmd",
                  "measure tail α per length bin and KV budget; write the cheapest schedule meeting τ"),
    "export": ("sparrow.cli.export_cmd", "write a run's checkpoint as a Hugging Face model directory (safetensors, config, tokenizer)"),
    "pool": ("sparrow.cli.pool_cmd", "resize a running job's rollout pool, or show its pools (RUN_DIR/control/)"),
}


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


class VersionAction(argparse.Action):
    """`--version`: looks the installed version up only when asked (importlib.metadata takes ~0.1 s)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the installed version and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        from importlib.metadata import version

        print(f"sparrow {version('sparrow-rl')}")
        parser.exit()


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand listed and only `command`'s own arguments filled in."""
    parser = argparse.ArgumentParser(
        prog="sparrow",
        description="Sparse-attention rollouts for long-context RL, held at a target tail acceptance rate.",
    )
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            importlib.import_module(module).configure(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # The top-level options take no value, so the first word that is not an option is the command.
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except (CliError, ValueError, FileNotFoundError) as exc:
        print(f"sparrow {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
