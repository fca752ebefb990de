"""Versions as files in shared memory, for readers on this server's host, run by its user.

A reader on another host is sent a version's bytes; one on this host (its ``ReadRequest.host``
is this kernel's boot id and this user, ``psserver.common.version_files.host_id``) is handed the
name of a file that holds them instead: written once per version and dtype, whatever the number
of such readers, into this process's own directory under the user's private directory of
version files. The readers of a host share one copy through it with no copy of their own (their
fetcher links the file into their copy), and a reader by itself maps it. Files of the two newest
versions are kept (a reader may be opening the older one); a reader that opened a file keeps it
however long it holds the version. A server whose files cannot be written (a full or missing
``/dev/shm``) sends the bytes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import threading
from pathlib import Path

from psserver.common import version_files
from psserver.common.versions import Version
from psserver.errors import UsageError

log = logging.getLogger(__name__)

KEPT_STEPS = 2
"""Versions whose files are kept: the newest and the one before, which a reader may be opening."""
PREFIX = "server-"


class VersionFiles:
    def __init__(self, base: Path | None = None) -> None:
        self.host = version_files.host_id()
        self._base = base
        self._lock = threading.Lock()
        self._dir: int | None = None
        self.path: Path | None = None
        self._files: dict[tuple[int, str], str] = {}
        self._failed = False
        self.written = 0
        """Files written (one per version and dtype asked for)."""

    def path_for(self, version: Version, dtype: str, reader_host: str, model: str) -> str | None:
        """The file of ``version`` in ``dtype`` for a reader on ``reader_host``: None unless that
        is this host and user, or when this server cannot write its files."""
        if not reader_host or reader_host != self.host or self._failed:
            return None
        with self._lock:
            name = self._files.get((version.step, dtype))
            if name is None:
                try:
                    name = self._write(version, dtype, model)
                except (OSError, UsageError) as e:
                    self._failed = True
                    log.warning("cannot write versions for the readers of this host to shared memory (%s): they "
                                "are sent the bytes", getattr(e, "strerror", None) or e)
                    return None
            assert self.path is not None
            return str(self.path / name)

    def _write(self, version: Version, dtype: str, model: str) -> str:
        if self._dir is None:
            self._open()
        assert self._dir is not None
        encoded = version.encoded(dtype)
        name = f"v-{version.step:020d}-{dtype or 'held'}"
        version_files.write(self._dir, name, version_files.header_bytes(
            version.step, version.published_at, model, 0, 0.0, encoded.metas), encoded.data)
        self._files[(version.step, dtype)] = name
        self.written += 1
        steps = sorted({step for step, _ in self._files})
        for key in [k for k in self._files if k[0] not in steps[-KEPT_STEPS:]]:
            with contextlib.suppress(OSError):
                os.unlink(self._files.pop(key), dir_fd=self._dir)
        return name

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
            for name in self._files.values():
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self._dir)
            self._files.clear()
            os.close(self._dir)
            self._dir = None
            assert self.path is not None
            with contextlib.suppress(OSError):
                os.rmdir(self.path)
            with contextlib.suppress(OSError):
                os.rmdir(self.path.parent)  # the user's directory, when no reader's copy is in it
