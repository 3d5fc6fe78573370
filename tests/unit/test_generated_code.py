"""The committed protobuf/gRPC code in kvpager/v1 must be what proto/ generates."""

import pathlib

import pytest

from kvpager import protogen

pytest.importorskip("grpc_tools")


def test_generated_code_is_current(tmp_path: pathlib.Path):
    fresh = protogen.generate(tmp_path)
    assert fresh, "protoc generated nothing"
    committed_dir = protogen.REPO / "kvpager" / "v1"
    names = {p.name for p in fresh}
    committed = {p.name for p in committed_dir.iterdir() if p.name.endswith(("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))}
    assert names == committed, f"generated {sorted(names)} but committed {sorted(committed)}: run `make proto`"
    for path in fresh:
        assert path.read_text() == (committed_dir / path.name).read_text(), (
            f"kvpager/v1/{path.name} differs from what proto/ generates: run `make proto` and commit")
