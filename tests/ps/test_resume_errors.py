"""--resume with a checkpoint that does not fit: one line, exit 2, files untouched."""

from __future__ import annotations

import hashlib

import pytest

from psserver.checkpoint import checkpoint_path, write_checkpoint
from psserver.cli import main
from psserver.config import ServerConfig
from psserver.ps.server.server import ParameterServer


def make_checkpoint(tmp_path, model: str, devices: list[str]):
    server = ParameterServer(ServerConfig(model=model, devices=devices))
    try:
        path = checkpoint_path(tmp_path, 7)
        write_checkpoint(path, server.policy.snapshot())
    finally:
        server.engine.close()
    return path


def digest(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize(
    "saved,argv,fragment",
    [
        (("mlp", ["cpu"]), ["--model", "mnist_cnn"], "is for model 'mlp', this server runs 'mnist_cnn'"),
        (("mlp", ["cpu"]), ["--model", "mlp", "--devices", "cpu,cpu"], "has 1 stage(s), this server has 2"),
    ],
    ids=["other-model", "other-stages"],
)
def test_mismatched_checkpoint_is_refused(tmp_path, capsys, saved, argv, fragment):
    make_checkpoint(tmp_path, *saved)
    before = digest(tmp_path)
    code = main(["serve", "--no-control", "--checkpoint-dir", str(tmp_path), "--resume", *argv])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0], err
    assert digest(tmp_path) == before  # nothing overwritten, nothing added


def test_explicit_corrupt_path_is_refused(tmp_path, capsys):
    path = make_checkpoint(tmp_path, "mlp", ["cpu"])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert main(["serve", "--no-control", "--model", "mlp", "--resume", str(path)]) == 2
    assert "is truncated" in capsys.readouterr().err
