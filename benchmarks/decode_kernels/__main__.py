"""`python -m sparrow.bench.decode_kernels [options]`: `sparrow bench kernels` without the rest of the CLI."""

import argparse
import sys

from .cli import register, run_kernels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparrow.bench.decode_kernels")
    register(parser.add_subparsers(dest="action", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    return run_kernels(parser.parse_args(["kernels", *argv]), "python -m sparrow.bench.decode_kernels " + " ".join(argv))


if __name__ == "__main__":
    sys.exit(main())
