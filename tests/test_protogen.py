"""The checked-in generated wire code is current, and the generator keeps it so."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from baton import protogen

EXTRA_PROTO = """syntax = "proto3";
package baton.v1;
import "baton/v1/kvtransfer.proto";

service Echo {
  rpc Again(KVEnd) returns (PushReply);
}
"""


def test_checked_in_generated_code_is_current(capsys):
    assert protogen.main(["--check"]) == 0, capsys.readouterr().err


def test_generated_modules_import_and_describe_the_service():
    from baton.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

    service = kvtransfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"]
    push = service.methods_by_name["Push"]
    assert push.client_streaming and not push.server_streaming
    assert hasattr(kvtransfer_pb2_grpc, "KVTransferStub")
    assert Path(kvtransfer_pb2.__file__).with_suffix(".pyi").exists()


@pytest.fixture()
def repo_copy(tmp_path: Path) -> Path:
    """A minimal repository: the protos and the generated package, nothing else."""
    shutil.copytree(protogen.REPO_ROOT / "proto", tmp_path / "proto")
    shutil.copytree(protogen.REPO_ROOT / "baton", tmp_path / "baton", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_check_lists_edited_missing_and_orphaned_files(repo_copy: Path, capsys):
    generated = repo_copy / "baton" / "v1"
    with open(generated / "kvtransfer_pb2.py", "a") as edited:
        edited.write("# hand edit\n")
    (generated / "kvtransfer_pb2.pyi").unlink()
    (generated / "removed_pb2.py").write_text("# its .proto was deleted\n")
    assert sorted(protogen.find_stale(repo_copy)) == [
        "baton/v1/kvtransfer_pb2.py (differs)",
        "baton/v1/kvtransfer_pb2.pyi (missing)",
        "baton/v1/removed_pb2.py (orphaned: its .proto is gone)",
    ]
    assert protogen.main(["--check", "--root", str(repo_copy)]) == 1
    assert "removed_pb2.py" in capsys.readouterr().err
    assert protogen.main(["--root", str(repo_copy)]) == 0
    assert protogen.find_stale(repo_copy) == []
    assert not (generated / "removed_pb2.py").exists()


def test_new_proto_is_picked_up_and_imports_its_siblings(repo_copy: Path):
    (repo_copy / "proto" / "baton" / "v1" / "echo.proto").write_text(EXTRA_PROTO)
    assert protogen.find_stale(repo_copy) == [
        "baton/v1/echo_pb2.py (missing)",
        "baton/v1/echo_pb2.pyi (missing)",
        "baton/v1/echo_pb2_grpc.py (missing)",
    ]
    assert protogen.main(["--root", str(repo_copy)]) == 0
    # A fresh interpreter in the copy imports the new modules, and through them the sibling.
    probe = (
        "import baton.v1.echo_pb2_grpc as g, baton.v1.echo_pb2 as m; "
        "assert m.__file__.startswith(%r); print(m.DESCRIPTOR.services_by_name['Echo'].full_name)"
    ) % str(repo_copy)
    done = subprocess.run([sys.executable, "-c", probe], cwd=repo_copy, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "baton.v1.Echo"
