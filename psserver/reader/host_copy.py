"""One copy of the newest version per host, shared by the readers of one server on that host.

Readers made with ``share=True`` keep a private directory of their user in shared memory
(``/dev/shm/psserver-readers-<uid>/<server and dtype>/``, 0700): each one's thread waits for
the directory's lock, and the one holding it fetches every new version from the server and
writes it as a file of its own (``v-<step>-<history>-<fetcher pid>``: written under a temporary
name, then renamed, so a file is whole or absent, never half of one version and half of
another). Readers take only the files of a fetcher that lives: a copy left by readers of an
earlier run, or of a server since started again, is never served as the newest; a fetcher
that takes over first fetches the server's newest, and one that meets a new history (the
server started again) removes the older history's files before it publishes. A server on this
host and user hands over its own file of the version instead, which the fetcher links in
(``psserver.common.version_files``): no copy of the bytes at all. Every reader reads
the newest file; a file being replaced stays readable by whoever opened it. The server sends
each version to the host once, whatever the number of readers on it. When the fetcher's
process ends or dies, the kernel drops its lock and another reader's thread takes over.

Nothing in the directory is trusted unless this user owns it and nobody else can write it
(``psserver.utils.private_paths``): another local user cannot feed a reader weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

from psserver.common import version_files
from psserver.errors import ServerUnavailable, UsageError
from psserver.reader.raw import Raw
from psserver.utils.private_paths import DIR_FLAGS

log = logging.getLogger(__name__)

KEPT = 2
"""Versions kept in the directory: the newest and the one before, which a reader may be reading."""
POLL_S = 0.002
"""How often a waiting reader looks whether the directory changed (one ``fstat``: a microsecond)."""
LOCK_RETRY_S = 0.2
FETCH_WAIT_S = 1.0
"""How long one fetch waits for a newer version before the fetcher asks again (and notices a close)."""
PREFIX = "v-"


def parse_name(name: str) -> tuple[int, str, int] | None:
    """The step, history and fetcher's pid a version file's name holds (None: not one)."""
    parts = name[len(PREFIX):].split("-") if name.startswith(PREFIX) else []
    if len(parts) != 3 or not parts[0].isdigit() or not parts[2].isdigit():
        return None
    return int(parts[0]), parts[1], int(parts[2])


class DirectoryWatch:
    """Wakes a waiting reader when a file is renamed into the directory (Linux inotify, through
    libc): no reader spins while no version comes. Where inotify cannot be had, ``wait`` sleeps
    ``POLL_S`` and the caller looks again."""

    IN_MOVED_TO = 0x00000080
    IN_NONBLOCK, IN_CLOEXEC = 0o4000, 0o2000000

    def __init__(self, path: Path) -> None:
        self.fd: int | None = None
        try:
            import ctypes
            import ctypes.util

            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fd = libc.inotify_init1(self.IN_NONBLOCK | self.IN_CLOEXEC)
            if fd < 0:
                return
            if libc.inotify_add_watch(fd, os.fsencode(path), self.IN_MOVED_TO) < 0:
                os.close(fd)
                return
            self.fd = fd
        except (OSError, AttributeError):
            self.fd = None

    def wait(self, timeout: float) -> None:
        """Until a file is renamed into the directory, at most ``timeout`` s."""
        if self.fd is None:
            time.sleep(min(timeout, POLL_S))
            return
        import select

        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if ready:
            with contextlib.suppress(BlockingIOError):
                os.read(self.fd, 65536)  # the events: only their arrival matters

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class HostCopy:
    """The shared copy of one server's versions in one dtype; ``fetch(newer_than, timeout,
    history)`` gets one from the server (None: none came)."""

    def __init__(self, address: str, dtype: str, fetch: Callable[[int | None, float, str], Raw | None]) -> None:
        self.path = version_files.root() / self.key(address, dtype)
        self._fetch = fetch
        self._me = f"reader-{os.getpid()}-{secrets.token_hex(4)}"
        for attempt in range(3):
            self._dir = version_files.private_dir(self.path, "readers' shared copy")
            try:  # the last reader of the host may have removed the directory meanwhile
                os.close(os.open(self._me, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o600, dir_fd=self._dir))
                break
            except FileNotFoundError:
                os.close(self._dir)
                if attempt == 2:
                    raise UsageError(f"readers' shared copy: {self.path} keeps vanishing") from None
        self._watch = DirectoryWatch(self.path)
        self._closed = threading.Event()
        self.fetching = False
        """Whether this process's thread holds the lock: it fetches for the host."""
        self._thread = threading.Thread(target=self._serve, name="psserver-host-copy", daemon=True)
        self._thread.start()

    @staticmethod
    def key(address: str, dtype: str) -> str:
        """The directory of the copy of ``address``'s versions in ``dtype``."""
        return hashlib.sha256(f"{address}|{dtype}".encode()).hexdigest()[:20]

    def close(self) -> None:
        """Stop; the last reader of the host removes the copy (under the lock: no fetcher writes)."""
        self._closed.set()
        self._thread.join(timeout=FETCH_WAIT_S + 35.0)
        self._watch.close()
        with contextlib.suppress(OSError):
            os.unlink(self._me, dir_fd=self._dir)
        try:
            if not any(n.startswith("reader-") and _alive_in(n.split("-")[1]) for n in self._listdir()):
                self._remove_if_unused()
        finally:
            os.close(self._dir)

    def _remove_if_unused(self) -> None:
        lock = os.open("lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=self._dir)
        try:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # a reader came and fetches: the copy is its
            if any(n.startswith("reader-") for n in self._listdir()):
                return
            for name in self._listdir():
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self._dir)
            with contextlib.suppress(OSError):
                os.rmdir(self.path)
            with contextlib.suppress(OSError):
                os.rmdir(self.path.parent)  # the user's root, when no other server's copy is in it
        finally:
            os.close(lock)

    # ---- the fetcher ----------------------------------------------------------------------

    def _serve(self) -> None:
        lock = os.open("lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=self._dir)
        try:
            while not self._closed.is_set():
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    self._closed.wait(LOCK_RETRY_S)
                    continue
                self.fetching = True
                log.info("this reader fetches the versions for the readers of this host (%s)", self.path)
                self._fetch_while_open()
        finally:
            os.close(lock)  # the lock goes with it: another reader takes over

    def _fetch_while_open(self) -> None:
        failures = 0
        self._remove_versions(keep=None)  # an earlier fetcher's: this one fetches the newest first
        while not self._closed.is_set():
            try:
                newest = self._newest()
                step, history = (-1, "") if newest is None else newest[:2]
                raw = self._fetch(step, FETCH_WAIT_S, history)  # -1: waits for a model too
            except (ServerUnavailable, UsageError) as e:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    log.warning("fetching a version for the readers of this host failed (%s); trying again", e)
                self._closed.wait(min(1.0, 0.1 * failures))
                continue
            failures = 0
            if raw is not None:
                try:
                    self._publish(raw)
                except OSError as e:  # a full /dev/shm, say: the readers keep the version they have
                    log.warning("cannot write version %d for the readers of this host to %s (%s)", raw.step,
                                self.path, e.strerror or e)
                    self._closed.wait(1.0)

    def _publish(self, raw: Raw) -> None:
        newest = self._newest()
        if newest is not None and newest[1] != raw.history:  # the server started again: its steps anew
            self._remove_versions(keep=None)
        tmp = f".{PREFIX}{raw.step}.{os.getpid()}.tmp"
        if raw.path is not None:  # the server's own file (it is on this host): linked, not copied
            os.link(raw.path, tmp, dst_dir_fd=self._dir, follow_symlinks=False)
        else:
            version_files.write(self._dir, tmp, version_files.header_bytes(
                raw.step, raw.published_at, raw.model, raw.crc32, raw.clock, raw.metas, raw.history), raw.data)
        try:
            os.rename(tmp, f"{PREFIX}{raw.step:020d}-{raw.history}-{os.getpid()}", src_dir_fd=self._dir,
                      dst_dir_fd=self._dir)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._dir)
            raise
        self._remove_versions(keep=KEPT)
        for name in self._listdir():  # what a fetcher that died mid-write left
            if name.endswith(".tmp") and not _alive_in(name.split(".")[-2]):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self._dir)

    # ---- every reader ---------------------------------------------------------------------

    def _listdir(self) -> list[str]:
        """The directory's names, through a descriptor of this call's own: ``os.listdir`` of a
        shared descriptor moves its one offset, and the fetcher's thread and the reader's, listing
        at once, each saw part of the names (a version fetched twice, an old one never removed)."""
        fd = os.open(".", DIR_FLAGS, dir_fd=self._dir)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def _versions(self) -> list[str]:
        """The names of the versions whose fetcher lives, oldest first (one history: a fetcher
        removes the files of another before it publishes)."""
        named = [(parse_name(n), n) for n in self._listdir() if n.startswith(PREFIX)]
        return [n for parsed, n in sorted(x for x in named if x[0] is not None) if version_files.alive(parsed[2])]

    def _newest(self) -> tuple[int, str, int] | None:
        names = self._versions()
        return parse_name(names[-1]) if names else None

    def _remove_versions(self, keep: int | None) -> None:
        """(The fetcher) every version file but this fetcher's newest ``keep`` (None: all of them)."""
        own = [n for n in self._versions() if parse_name(n)[2] == os.getpid()]  # type: ignore[index]
        kept = set(own[-keep:]) if keep else set()
        for name in self._listdir():
            if name.startswith(PREFIX) and name not in kept:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=self._dir)

    def sharing(self) -> int:
        """The readers on this host that share the copy (their processes alive)."""
        alive = 0
        for name in self._listdir():
            if not name.startswith("reader-"):
                continue
            if _alive_in(name.split("-")[1]):
                alive += 1
            else:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self._dir)
        return max(alive, 1)

    def read(self, newer_than: int | None, timeout: float, history: str = "") -> Raw | None:
        """The newest version in the copy (past ``newer_than``, or of another ``history`` than
        its, waiting up to ``timeout`` s)."""
        deadline = time.monotonic() + timeout
        while True:
            names = self._versions()  # after the watch was armed: no rename falls between
            newest = parse_name(names[-1]) if names else None
            if newest is not None and (newer_than is None or newest[0] > newer_than
                                       or (history and newest[1] != history)):
                raw = self._load(names[-1])
                if raw is not None:
                    return raw
                if names[-1] in self._listdir():  # not gone: it holds another version than its name's
                    raise UsageError(f"readers' shared copy: {self.path / names[-1]} does not hold the version "
                                     "its name says")
                continue  # replaced while it was opened: the newer one is there
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._watch.wait(min(left, 1.0))

    def _load(self, name: str) -> Raw | None:
        """The version in file ``name`` (None: replaced and gone before it was opened)."""
        found = version_files.load(self._dir, name, self.path / name, "readers' shared copy")
        if found is None:
            return None
        raw = Raw.of_file(*found)
        # The server's file, linked in, holds the step of its name: the server writes a file again
        # only once no name of this copy links it; a name removed meanwhile is a newer file's.
        step, history, _ = parse_name(name)  # type: ignore[misc]
        return raw if (raw.step, raw.history) == (step, history) else None


def _alive_in(text: str) -> bool:
    """Whether the process whose id ``text`` is (part of a file's name) is alive."""
    return version_files.alive(version_files.pid_of(text))
