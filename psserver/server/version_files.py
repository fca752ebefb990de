"""Versions as files in shared memory, for readers on this server's host, run by its user.

A reader on another host is sent a version's bytes; one on this host (its ``ReadRequest.host``
is this kernel's boot id and this user, ``psserver.common.version_files.host_id``) is handed the
name of a file that holds them instead: written once per version and dtype, whatever the number
of such readers, into this process's own directory under the user's private directory of
version files. The readers of a host share one copy through it with no copy of their own (their
fetcher links the file into their copy), and a reader by itself maps it. Files of the two newest
versions are named (a reader may be opening the older one); a reader that opened a file keeps it
however long it holds the version, under a shared ``flock``. Older files are written again with
newer versions once no reader holds them (no shared lock) or links them (no name in a readers'
copy): their pages are in memory already. A server whose files cannot be written (a full or
missing ``/dev/shm``) sends the bytes.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path

from psserver.common import version_files
from psserver.common.versions import Version
from psserver.errors import UsageError

log = logging.getLogger(__name__)

KEPT_STEPS = 2
"""Versions whose files are kept: the newest and the one before, which a reader may be opening."""
SPARE_FILES = 2
"""Files of older versions kept to be written again (a new file's pages cost the kernel's page
faults and zeroing, as much as the copy into them)."""
PREFIX = "server-"


@dataclass
class _File:
    name: str
    fd: int
    """Open for writing as long as the server may write it again."""


class VersionFiles:
    def __init__(self, base: Path | None = None) -> None:
        self.host = version_files.host_id()
        self._base = base
        self._lock = threading.Lock()
        self._dir: int | None = None
        self.path: Path | None = None
        self._files: dict[tuple[int, str], _File] = {}
        self._spare: list[_File] = []
        """Files of older versions, written again once no reader holds or links them."""
        self._failed = False
        self.written = 0
        """Versions written (one per version and dtype asked for)."""
        self.reused = 0
        """Of them, into a file of an older version (its pages in memory already: no page faults)."""

    def path_for(self, version: Version, dtype: str, reader_host: str, model: str) -> str | None:
        """The file of ``version`` in ``dtype`` for a reader on ``reader_host``: None unless that
        is this host and user, or when this server cannot write its files."""
        if not reader_host or reader_host != self.host or self._failed:
            return None
        with self._lock:
            found = self._files.get((version.step, dtype))
            if found is None:
                try:
                    found = self._write(version, dtype, model)
                except (OSError, UsageError) as e:
                    self._failed = True
                    log.warning("cannot write versions for the readers of this host to shared memory (%s): they "
                                "are sent the bytes", getattr(e, "strerror", None) or e)
                    return None
            assert self.path is not None
            return str(self.path / found.name)

    def _write(self, version: Version, dtype: str, model: str) -> _File:
        if self._dir is None:
            self._open()
        assert self._dir is not None
        encoded = version.encoded(dtype)
        header = version_files.header_bytes(version.step, version.published_at, model, 0, 0.0, encoded.metas,
                                            version.history)
        name = f"v-{version.step:020d}-{dtype or 'held'}"
        file = self._free(len(header) + len(encoded.data))
        if file is None:
            fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                         dir_fd=self._dir)
            file = _File(name, fd)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            _write_all(file.fd, header, encoded.data)
            if file.name != name:  # an older version's file: its new name once it holds this one
                os.rename(file.name, name, src_dir_fd=self._dir, dst_dir_fd=self._dir)
                file.name = name
                self.reused += 1
        except BaseException:
            self._drop(file)
            raise
        finally:
            with contextlib.suppress(OSError):
                fcntl.flock(file.fd, fcntl.LOCK_UN)
        self._files[(version.step, dtype)] = file
        self.written += 1
        steps = sorted({step for step, _ in self._files})
        for key in [k for k in self._files if k[0] not in steps[-KEPT_STEPS:]]:
            self._spare.append(self._files.pop(key))
        while len(self._spare) > SPARE_FILES:
            self._drop(self._spare.pop(0))
        return file

    def _free(self, size: int) -> _File | None:
        """A spare file nobody holds (no reader's shared lock) or links (no name of a readers'
        copy): held under the exclusive lock, sized ``size``; None when there is none."""
        assert self._dir is not None
        for file in sorted(self._spare, key=lambda f: os.fstat(f.fd).st_size != size):
            try:
                fcntl.flock(file.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            if os.fstat(file.fd).st_nlink != 1:
                fcntl.flock(file.fd, fcntl.LOCK_UN)
                continue
            self._spare.remove(file)
            # Renamed out of the way first: a reader that opens the old name from now on finds
            # nothing; one that opened it before waits for the lock, then sees a newer step.
            tmp = f".w-{secrets.token_hex(4)}"
            os.rename(file.name, tmp, src_dir_fd=self._dir, dst_dir_fd=self._dir)
            file.name = tmp
            if os.fstat(file.fd).st_size != size:
                os.ftruncate(file.fd, size)
            return file
        return None

    def _drop(self, file: _File) -> None:
        with contextlib.suppress(OSError):
            os.unlink(file.name, dir_fd=self._dir)
        with contextlib.suppress(OSError):
            os.close(file.fd)

    def _open(self) -> None:
        root = self._base or version_files.root()
        self.path = root / f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
        self._dir = version_files.private_dir(self.path, "this server's versions for readers")
        for stale in root.glob(f"{PREFIX}*-*"):  # of a server that died (root is this user's alone: checked)
            pid = version_files.pid_of(stale.name[len(PREFIX):].split("-")[0])
            if stale != self.path and not version_files.alive(pid) and stale.is_dir() and not stale.is_symlink():
                shutil.rmtree(stale, ignore_errors=True)
        log.info("versions for the readers of this host go to %s", self.path)

    def close(self) -> None:
        with self._lock:
            if self._dir is None:
                return
            for file in [*self._files.values(), *self._spare]:
                self._drop(file)
            self._files.clear()
            self._spare.clear()
            os.close(self._dir)
            self._dir = None
            assert self.path is not None
            with contextlib.suppress(OSError):
                os.rmdir(self.path)
            with contextlib.suppress(OSError):
                os.rmdir(self.path.parent)  # the user's directory, when no reader's copy is in it


def _write_all(fd: int, header: bytes, data: object) -> None:
    """``header`` then ``data`` from the start of ``fd``."""
    at = 0
    for part in (memoryview(header), memoryview(data).cast("B")):
        while part:
            n = os.pwrite(fd, part, at)
            part, at = part[n:], at + n
