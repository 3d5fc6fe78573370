"""Regenerate the committed protobuf/gRPC code in kvpager/v1 from proto/ (``make proto``).

The generated files are committed so that no install step needs grpcio-tools;
tests/unit/test_generated_code.py regenerates them into a temporary folder and fails on
any difference.
"""

from __future__ import annotations

import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc over every .proto under proto/, writing Python modules under out_dir."""
    from grpc_tools import protoc  # only needed here; not an install-time dependency

    import grpc_tools

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    generated = out_dir / "kvpager" / "v1"
    return sorted(p for p in generated.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")))


def main() -> None:
    written = generate(REPO)
    for path in written:
        print(path.relative_to(REPO))


if __name__ == "__main__":
    sys.exit(main())
