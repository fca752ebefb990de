"""Versions as files for readers on the server's host and user: one file per version and dtype
however many ask, none for a reader elsewhere, the two newest versions kept, nothing left
behind by a close or by a server that died."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from psserver.common import version_files
from psserver.common.versions import Version, pack
from psserver.server.version_files import SPARE_FILES, VersionFiles
from psserver.utils.private_paths import DIR_FLAGS


def version(step: int) -> Version:
    state, packed = pack({"w": torch.full((2, 3), float(step)), "n": torch.tensor([step])})
    return Version(step, 100.0 + step, state, packed)


@pytest.fixture
def files(tmp_path):
    f = VersionFiles(tmp_path / "readers")
    yield f
    f.close()


def test_a_reader_of_this_host_gets_one_file_per_version_and_dtype(files):
    v = version(3)
    paths = {files.path_for(v, "", files.host, "toy") for _ in range(4)}
    assert len(paths) == 1 and files.written == 1
    path = paths.pop()
    directory = os.open(os.path.dirname(path), DIR_FLAGS)
    try:
        header, data = version_files.load(directory, os.path.basename(path), path, "test")
    finally:
        os.close(directory)
    assert (header["step"], header["published_at"], header["model"]) == (3, 103.0, "toy")
    assert bytes(data) == bytes(v.encoded("").data)
    half = files.path_for(v, "bfloat16", files.host, "toy")
    assert half != path and files.written == 2
    assert os.path.getsize(half) < os.path.getsize(path)


def test_a_reader_elsewhere_or_of_another_user_gets_none(files):
    v = version(1)
    assert files.path_for(v, "", "", "toy") is None
    assert files.path_for(v, "", "another-boot-id/0", "toy") is None
    assert files.path_for(v, "", files.host.rsplit("/", 1)[0] + "/99999", "toy") is None
    assert files.written == 0 and files.path is None  # nothing made for them


def test_the_two_newest_versions_are_named_and_older_files_written_again(files):
    for step in range(1, 6):
        files.path_for(version(step), "", files.host, "toy")
    names = sorted(os.listdir(files.path))
    assert [f"v-{s:020d}-held" for s in (4, 5)] == names[-2:] and len(names) <= 2 + SPARE_FILES
    assert files.written == 5 and files.reused == 2  # steps 4 and 5 went into the pages of 1 and 2


def test_a_file_a_reader_holds_or_links_is_not_written_again(files, tmp_path):
    held = files.path_for(version(1), "", files.host, "toy")
    directory = os.open(os.path.dirname(held), DIR_FLAGS)
    try:
        header, data = version_files.load(directory, os.path.basename(held), held, "test")  # a reader maps it
    finally:
        os.close(directory)
    linked = files.path_for(version(2), "", files.host, "toy")
    os.link(linked, tmp_path / "a-readers-copy")  # a readers' copy links it
    for step in (3, 4, 5):
        files.path_for(version(step), "", files.host, "toy")
    assert files.reused == 0  # every version into a new file
    assert bytes(data) == bytes(version(1).encoded("").data) and header["step"] == 1  # what the reader holds
    del data
    os.unlink(tmp_path / "a-readers-copy")
    files.path_for(version(6), "", files.host, "toy")
    assert files.reused == 1


def test_close_removes_the_files_and_a_dead_servers_are_swept(files, tmp_path):
    files.path_for(version(1), "", files.host, "toy")
    mine = files.path
    files.close()
    assert not mine.exists() and not (tmp_path / "readers").exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    stale = tmp_path / "readers" / f"server-{dead}-0123"
    stale.mkdir(parents=True, mode=0o700)
    os.chmod(tmp_path / "readers", 0o700)
    (stale / "v-1-held").write_bytes(b"x")
    again = VersionFiles(tmp_path / "readers")
    try:
        assert again.path_for(version(2), "", again.host, "toy") is not None
        assert not stale.exists()
    finally:
        again.close()


def test_a_server_that_cannot_write_sends_the_bytes(tmp_path, caplog):
    (tmp_path / "readers").mkdir(mode=0o777)
    os.chmod(tmp_path / "readers", 0o777)  # another user could put files there: never used
    files = VersionFiles(tmp_path / "readers")
    with caplog.at_level(logging.WARNING):
        assert files.path_for(version(1), "", files.host, "toy") is None
        assert files.path_for(version(2), "", files.host, "toy") is None
    assert len([r for r in caplog.records if "sent the bytes" in r.message]) == 1
    files.close()
