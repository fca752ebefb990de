"""A reader on the server's host takes the server's own file of a version: only a file of this
user's alone, under this user's directory of version files, of the step the header says; where
the server's directory is not to be seen (another container), it asks for the bytes from then on."""

from __future__ import annotations

import os

import pytest
import torch

from psserver.common import version_files
from psserver.control.v1 import control_pb2 as pb
from psserver.errors import UsageError
from psserver.reader.reader import Reader


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setattr(version_files, "root", lambda: tmp_path / "readers")
    return tmp_path / "readers"


@pytest.fixture
def reader():
    r = Reader("127.0.0.1:1", timeout=1.0)  # never connects: only its checks of a named file run
    yield r
    r.close()


def server_file(root, step: int = 4, name: str = "v-4") -> str:
    directory = root / "server-1-ab"
    fd = version_files.private_dir(directory, "test")
    try:
        data = torch.full((2, 3), float(step)).numpy().tobytes()
        version_files.write(fd, name, version_files.header_bytes(step, 1.0, "toy", 0, 0.0,
                                                                 [("w", "float32", (2, 3), 24)]), data)
    finally:
        os.close(fd)
    return str(directory / name)


def test_the_servers_file_is_mapped(root, reader):
    path = server_file(root)
    raw = reader._server_file(pb.VersionHeader(step=4, path=path))
    assert raw.path == path and raw.step == 4 and raw.model == "toy"
    assert torch.frombuffer(raw.data, dtype=torch.float32).tolist() == [4.0] * 6
    assert reader._version(raw).state["w"].shape == (2, 3)


def test_a_file_outside_this_users_directory_is_refused(root, reader, tmp_path):
    server_file(root)
    with pytest.raises(UsageError, match="not in this user's directory of version files"):
        reader._server_file(pb.VersionHeader(step=4, path=str(tmp_path / "elsewhere" / "v-4")))
    with pytest.raises(UsageError, match="not in this user's directory of version files"):
        reader._server_file(pb.VersionHeader(step=4, path=str(root / "server-1-ab" / ".." / "v-4")))


def test_a_file_others_could_write_is_refused_and_one_of_another_step_asked_again(root, reader):
    path = server_file(root)
    assert reader._server_file(pb.VersionHeader(step=5, path=path)) is None  # the server wrote it again since
    os.chmod(path, 0o666)
    with pytest.raises(UsageError, match="writable by its group or others"):
        reader._server_file(pb.VersionHeader(step=4, path=path))


def test_a_truncated_file_is_refused(root, reader):
    path = server_file(root)
    os.truncate(path, os.path.getsize(path) - 4)
    with pytest.raises(UsageError, match="holds 20 bytes of tensors, its header 24"):
        reader._server_file(pb.VersionHeader(step=4, path=path))


def test_a_file_gone_is_asked_again_and_a_directory_not_seen_ends_the_files(root, reader):
    path = server_file(root)
    os.unlink(path)
    assert reader._server_file(pb.VersionHeader(step=4, path=path)) is None
    assert reader._host_id  # a race with the server's removal: the next read asks for a file again
    assert reader._server_file(pb.VersionHeader(step=4, path=str(root / "server-2-cd" / "v-4"))) is None
    assert reader._host_id == ""  # the server's shared memory is not this reader's: the bytes from now on
