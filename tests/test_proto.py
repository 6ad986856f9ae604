"""Generated gRPC code is never edited by hand: regenerating it must reproduce the files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# (include dir, .proto under it, where the generated files live) as deploy/gen_proto.sh says
PROTOS = [
    (".", "proto/pdserve/v1/kv_transfer.proto", "."),
    ("proto", "pdserve/v1/generate.proto", "client"),
]


@pytest.mark.parametrize(("include", "src", "out"), PROTOS, ids=lambda v: str(v))
def test_generated_code_is_current(tmp_path, include, src, out):
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            str(REPO / include),
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            str(REPO / include / src),
        ],
        check=True,
    )
    stem = Path(src).with_suffix("")
    for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi"):
        name = stem.name + suffix
        fresh = (tmp_path / stem.parent / name).read_text()
        kept = (REPO / out / stem.parent / name).read_text()
        assert fresh == kept, f"{out}/{stem.parent}/{name} is stale: run deploy/gen_proto.sh"


def test_every_proto_is_generated():
    listed = {(REPO / inc / src).resolve() for inc, src, _ in PROTOS}
    assert set((REPO / "proto").rglob("*.proto")) == listed


def test_public_api_imports_without_the_server():
    # the client distribution's generated code: protobuf and grpcio only
    code = (
        "import sys; from pdserve.v1 import generate_pb2, generate_pb2_grpc; "
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules; "
        "print(generate_pb2.DESCRIPTOR.services_by_name['Generation'].full_name)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO / "client",
    )
    assert out.stdout.strip() == "pdserve.v1.Generation"
