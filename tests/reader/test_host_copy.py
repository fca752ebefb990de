"""Readers of one host share one copy: one of them fetches each version from the server, the
others read it from shared memory; when the fetcher goes, another takes over; a file another
user could have written is never read."""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
import torch

from psserver.common import version_files
from psserver.errors import UsageError
from psserver.reader import host_copy
from psserver.reader.host_copy import HostCopy
from psserver.reader.raw import Raw


class Server:
    """Versions as the server would send them: step n's every value is n; fetches counted."""

    def __init__(self) -> None:
        self.step = 0
        self.history = "aa"
        self.fetches = 0
        self.changed = threading.Condition()

    def train(self) -> None:
        with self.changed:
            self.step += 1
            self.changed.notify_all()

    def restart(self, step: int, history: str) -> None:
        """Started again (from an older checkpoint): at ``step``, under another history."""
        with self.changed:
            self.step, self.history = step, history
            self.changed.notify_all()

    def fetch(self, newer_than: int | None, timeout: float, history: str = "") -> Raw | None:
        with self.changed:
            if not self.changed.wait_for(lambda: newer_than is None or self.step > newer_than
                                         or (history and history != self.history), timeout):
                return None
            step, of = self.step, self.history
            self.fetches += 1
        data = bytearray(torch.full((6,), float(step)).numpy().tobytes())
        return Raw(step, time.time(), "toy", 0, [("w", "float32", (2, 3), 24)], data, 0.0, history=of)


@pytest.fixture(autouse=True)
def private_root(tmp_path, monkeypatch):
    monkeypatch.setattr(version_files, "root", lambda: tmp_path / "readers")


def values(raw: Raw) -> set[float]:
    return set(torch.frombuffer(raw.data, dtype=torch.float32).tolist())


def test_one_reader_fetches_for_all_and_each_version_once():
    server = Server()
    copies = [HostCopy("10.0.0.5:50051", "bfloat16", server.fetch) for _ in range(4)]
    try:
        server.train()
        seen = [c.read(0, 5.0) for c in copies]
        assert [r.step for r in seen] == [1] * 4 and all(values(r) == {1.0} for r in seen)
        for step in (2, 3):
            server.train()
            got = [c.read(step - 1, 5.0) for c in copies]
            assert [r.step for r in got] == [step] * 4
        assert sum(c.fetching for c in copies) == 1
        assert server.fetches <= 4  # steps 0 to 3: once per version at most, not once per reader
        assert copies[0].sharing() == 4
        deadline = time.monotonic() + 5  # the fetcher removes the oldest just after the newest is in
        while len([n for n in os.listdir(copies[0].path) if n.startswith("v-")]) > host_copy.KEPT:
            assert time.monotonic() < deadline, sorted(n for n in os.listdir(copies[0].path) if n.startswith("v-"))
            time.sleep(0.01)
    finally:
        for c in copies:
            c.close()
    assert not copies[0].path.exists()  # the last reader removes the host's copy


def test_when_the_fetcher_goes_another_reader_takes_over():
    server = Server()
    a, b = HostCopy("h:1", "", server.fetch), HostCopy("h:1", "", server.fetch)
    fetcher = None
    try:
        server.train()
        assert b.read(0, 5.0).step == 1
        fetcher, other = (a, b) if a.fetching else (b, a)
        fetcher.close()
        server.train()
        assert other.read(1, 5.0).step == 2 and other.fetching
    finally:
        for c in (a, b):
            if c is not fetcher:
                c.close()


def test_a_version_file_others_could_write_is_refused(tmp_path):
    server = Server()
    copy = HostCopy("h:2", "", server.fetch)
    try:
        server.train()
        assert copy.read(0, 5.0).step == 1
        newest = sorted(n for n in os.listdir(copy.path) if n.startswith("v-"))[-1]
        os.chmod(copy.path / newest, 0o666)
        with pytest.raises(UsageError, match="is writable by its group or others"):
            copy.read(None, 1.0)
    finally:
        copy.close()


def test_a_shared_directory_of_another_mode_is_refused(tmp_path):
    (tmp_path / "readers").mkdir(mode=0o700)
    key_dir = tmp_path / "readers" / "x"
    key_dir.mkdir(mode=0o755)
    os.chmod(key_dir, 0o777)
    with pytest.raises(UsageError, match="readers' shared copy"):
        version_files.private_dir(key_dir, "readers' shared copy")


def test_the_servers_own_file_is_linked_in_not_copied(tmp_path):
    """A server on this host hands its file of the version: every reader of the host reads that
    very file (one inode), and it outlives the server's removal of it."""
    server_dir = version_files.root() / "server-1-abc"
    dir_fd = version_files.private_dir(server_dir, "test")

    def fetch(newer_than: int | None, timeout: float, history: str = "") -> Raw | None:
        raw = Server.fetch(server, newer_than, timeout, history)
        if raw is None:
            return None
        name = f"v-{raw.step}"
        version_files.write(dir_fd, name, version_files.header_bytes(raw.step, raw.published_at, raw.model, 0, 0.0,
                                                                     raw.metas, raw.history), raw.data)
        return Raw.of_file(*version_files.load(dir_fd, name, server_dir / name, "test"), path=str(server_dir / name))

    server = Server()
    copies = [HostCopy("h:3", "", fetch) for _ in range(3)]
    try:
        server.train()
        got = [c.read(0, 5.0) for c in copies]
        assert [r.step for r in got] == [1] * 3 and all(values(r) == {1.0} for r in got)
        linked = os.stat(copies[0].path / f"{host_copy.PREFIX}{1:020d}-aa-{os.getpid()}")
        assert linked.st_ino == os.stat(server_dir / "v-1").st_ino and linked.st_nlink == 2
        os.unlink(server_dir / "v-1")
        assert values(copies[1].read(None, 1.0)) == {1.0}
    finally:
        for c in copies:
            c.close()
        os.close(dir_fd)


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_copy_left_by_the_readers_of_an_earlier_run_is_never_the_newest():
    """Readers of an earlier run on the same address were killed at step 1234, leaving their
    copy; the server now runs at step 5: a new reader's newest is 5, and the old file goes."""
    server = Server()
    server.step = 5
    path = version_files.root() / HostCopy.key("h:4", "")
    dir_fd = version_files.private_dir(path, "test")
    stale = f"{host_copy.PREFIX}{1234:020d}-ff-{_dead_pid()}"
    data = bytearray(torch.full((6,), 1234.0).numpy().tobytes())
    version_files.write(dir_fd, stale, version_files.header_bytes(1234, 0.0, "toy", 0, 0.0,
                                                                  [("w", "float32", (2, 3), 24)], "ff"), data)
    os.close(dir_fd)
    copy = HostCopy("h:4", "", server.fetch)
    try:
        assert copy.read(None, 5.0).step == 5
        assert stale not in os.listdir(copy.path)
    finally:
        copy.close()


def test_a_server_started_again_at_a_lower_step_is_followed():
    """The server went back to step 2 of a checkpoint (another history): readers waiting past
    step 3 of the old history take step 2 of the new one at once, never the old step 3."""
    server = Server()
    copies = [HostCopy("h:5", "", server.fetch) for _ in range(2)]
    try:
        for _ in range(3):
            server.train()
        assert [c.read(2, 5.0).step for c in copies] == [3, 3]
        server.restart(2, "bb")
        got = [c.read(3, 5.0, history="aa") for c in copies]
        assert [(r.step, r.history) for r in got] == [(2, "bb")] * 2 and all(values(r) == {2.0} for r in got)
        assert not [n for n in os.listdir(copies[0].path) if n.startswith(host_copy.PREFIX) and "-aa-" in n]
    finally:
        for c in copies:
            c.close()
