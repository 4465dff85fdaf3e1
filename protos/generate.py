"""Regenerate the committed Python stubs from the .proto sources.

    python -m sparrow.protos.generate            # rewrite the stubs next to the .proto files
    python -m sparrow.protos.generate --out DIR  # write them elsewhere (the test compares them)

Needs grpcio-tools 1.85.1 (the `dev` extra): its bundled protoc emits gencode 7.35.1, which the
runtime protobuf (>= 7.35.1, < 8) accepts. protoc writes `import sparrow_v1_pb2` in the gRPC
module; we rewrite it to a package-relative import so `sparrow.protos` works as a package.
"""

import argparse
import re
import sys
import tempfile
from importlib import resources
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTOS = ("sparrow_v1.proto",)
GRPC_TOOLS_VERSION = "1.85.1"


def _relative_imports(text: str) -> str:
    return re.sub(r"^import (\w+_pb2) as (\w+)$", r"from . import \1 as \2", text, flags=re.M)


def generate(out_dir: Path) -> list[Path]:
    """Write `*_pb2.py`, `*_pb2.pyi` and `*_pb2_grpc.py` for every proto into `out_dir`."""
    try:
        from grpc_tools import grpc_version, protoc
    except ImportError:
        raise SystemExit("grpcio-tools is not installed: pip install 'grpcio-tools==1.85.1' (the dev extra)") from None
    if grpc_version.VERSION != GRPC_TOOLS_VERSION:
        raise SystemExit(
            f"grpcio-tools {grpc_version.VERSION} is installed but the stubs are generated with {GRPC_TOOLS_VERSION}; "
            f"pip install 'grpcio-tools=={GRPC_TOOLS_VERSION}' so the output matches the committed files"
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = str(resources.files("grpc_tools") / "_proto")
    written = []
    for proto in PROTOS:
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_DIR}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(PROTO_DIR / proto),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")
        stem = proto.removesuffix(".proto")
        grpc_module = out_dir / f"{stem}_pb2_grpc.py"
        grpc_module.write_text(_relative_imports(grpc_module.read_text()))
        written += [out_dir / f"{stem}_pb2.py", out_dir / f"{stem}_pb2.pyi", grpc_module]
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sparrow.protos.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_DIR, help="output folder (default: next to the .proto files)")
    args = parser.parse_args(argv)
    # protoc writes into a scratch folder first, so a failed run leaves the committed stubs intact.
    with tempfile.TemporaryDirectory() as scratch:
        for path in generate(Path(scratch)):
            target = args.out / path.name
            target.write_bytes(path.read_bytes())
            print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
