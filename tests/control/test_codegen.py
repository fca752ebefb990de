"""The committed stubs match the proto (what CI runs) and import as psserver.control.v1."""

from __future__ import annotations

import pickle
import shutil

import pytest

pytestmark = pytest.mark.timeout(120)

grpc_tools = pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) regenerates the stubs")

from psserver.control import codegen  # noqa: E402


def test_committed_stubs_are_up_to_date(capsys):
    assert codegen.main(["--check"]) == 0, capsys.readouterr().err


def test_check_names_the_file_that_differs(tmp_path, monkeypatch, capsys):
    out = tmp_path / "v1"
    shutil.copytree(codegen.OUT_DIR, out)
    monkeypatch.setattr(codegen, "OUT_DIR", out)
    assert codegen.main(["--check"]) == 0
    grpc_file = out / "control_pb2_grpc.py"
    grpc_file.write_text(grpc_file.read_text().replace("psserver.control.v1", "psserver.v1"))
    capsys.readouterr()
    assert codegen.main(["--check"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "control_pb2_grpc.py" in err[0] and "control_pb2.py," not in err[0]
    (out / "control_pb2.pyi").unlink()
    assert codegen.main(["--check"]) == 1
    assert "control_pb2.pyi" in capsys.readouterr().err
    assert codegen.main([]) == 0  # regenerate in place
    assert codegen.main(["--check"]) == 0


def test_stubs_import_under_the_package_path():
    from psserver.control.v1 import control_pb2 as pb
    from psserver.control.v1 import control_pb2_grpc

    assert pb.ServerStatus.__module__ == "psserver.control.v1.control_pb2"
    assert control_pb2_grpc.psserver_dot_v1_dot_control__pb2 is pb
    assert pb.DESCRIPTOR.package == "psserver.v1"
    msg = pb.ServerStatus(model="mlp", state=pb.SERVER_STATE_SERVING)
    assert pickle.loads(pickle.dumps(msg)) == msg
