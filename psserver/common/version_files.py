"""Versions of the weights as files in shared memory, one format for every writer.

A version file is an 8-byte little-endian length, a JSON header of that length (the step,
when it was applied, the model's name, the CRC-32 of the bytes or 0 when not computed, the
writer's clock against the server's, each tensor's key, dtype, shape and bytes), then the
tensors' bytes. It is written whole before anyone is given its name; a server may write a later
version into it again, but only while no reader holds it (readers hold a shared ``flock`` as long
as they map it, the server the exclusive one while it writes: :func:`load`), so a reader that
maps it holds one version.

Two writers: the reader that fetches for the readers of its host (``psserver.reader.host_copy``)
and a server whose readers are on its own host and user (``psserver.server.version_files``),
which hands them its file instead of its bytes; the fetcher links that file into the readers'
copy, so that a version crosses from the server to every reader of its host without a copy.
Both live under this user's private directory in ``/dev/shm`` (:func:`root`), which nothing of
another user can write.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import mmap
import os
import stat
import struct
import tempfile
import weakref
from pathlib import Path
from typing import Any

from psserver.errors import UsageError
from psserver.utils.private_paths import DIR_FLAGS, not_private, unsafe_parent

LENGTH = struct.Struct("<Q")
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def root() -> Path:
    """This user's directory of version files (``/dev/shm``, else the temporary directory)."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    return base / f"psserver-readers-{os.geteuid()}"


def host_id() -> str:
    """This kernel's boot id and this user: a reader and a server that give the same one can hand
    each other files in :func:`root` (empty where the boot id cannot be read)."""
    try:
        boot = BOOT_ID.read_text().strip()
    except OSError:
        return ""
    return f"{boot}/{os.geteuid()}" if boot else ""


def header_bytes(step: int, published_at: float, model: str, crc32: int, clock: float,
                 metas: list[tuple[str, str, tuple[int, ...], int]], history: str = "") -> bytes:
    """What goes before the tensors' bytes in a version file."""
    header = json.dumps({"step": step, "published_at": published_at, "model": model, "crc32": crc32,
                         "clock": clock, "metas": metas, "history": history}).encode()
    return LENGTH.pack(len(header)) + header


def parse_header(mapped: Any) -> tuple[dict, int]:
    """A version file's header and where its bytes start (``ValueError`` for a damaged one)."""
    if len(mapped) < LENGTH.size:
        raise ValueError("shorter than its length field")
    (length,) = LENGTH.unpack_from(mapped, 0)
    if LENGTH.size + length > len(mapped):
        raise ValueError(f"a header of {length} bytes in a file of {len(mapped)}")
    header = json.loads(bytes(mapped[LENGTH.size:LENGTH.size + length]))
    return header, LENGTH.size + length


def load(dir_fd: int, name: str, shown: Path, what: str) -> tuple[dict, memoryview] | None:
    """The header and the bytes of version file ``name`` in the directory ``dir_fd`` (``shown``
    in errors, as ``what``'s), mapped, not read, so the version's tensors are views of the one
    copy in memory. A shared ``flock`` of the file is held as long as they live: a server writes
    another version into a file of its own only when nobody holds one (it holds the exclusive
    lock while it writes), so a mapped version never changes. The caller checks the header's
    step (a file written again since it was named holds a newer one). None when it is gone;
    ``UsageError`` unless it is a regular file of this user's alone, whole."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UsageError(f"{what}: {shown} is a symbolic link") from None
        raise
    try:
        st = os.fstat(fd)
        why = "is not a regular file" if not stat.S_ISREG(st.st_mode) else not_private(st)
        if why is not None:
            raise UsageError(f"{what}: {shown} {why}")
        fcntl.flock(fd, fcntl.LOCK_SH)  # held while mapped: the server writes no file a reader holds
        size = os.fstat(fd).st_size  # a server that used the file again may have written another size
        if size == 0:
            raise UsageError(f"{what}: {shown} is empty")
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ | mmap.PROT_WRITE, flags=mmap.MAP_PRIVATE)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(mapped, os.close, fd)  # the lock goes with the last view of the version
    try:
        header, start = parse_header(mapped)
        nbytes = sum(int(m[3]) for m in header["metas"])
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise UsageError(f"{what}: {shown} is damaged ({e})") from None
    if start + nbytes != len(mapped):
        raise UsageError(f"{what}: {shown} holds {len(mapped) - start} bytes of tensors, its header {nbytes}")
    return header, memoryview(mapped)[start:]


def write(dir_fd: int, name: str, header: bytes, data: Any) -> None:
    """``header`` and ``data`` into a new file ``name`` (0600) of the directory ``dir_fd``; a
    file half written is removed (``OSError``: a full ``/dev/shm``, say). Written before anyone
    knows its name: no lock needed."""
    fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(data)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=dir_fd)
        raise


def private_dir(path: Path, what: str, *, create: bool = True) -> int:
    """A descriptor of ``path`` (under :func:`root`), made 0700 when missing (``create``; else
    ``FileNotFoundError``); ``UsageError`` unless it is this user's alone. ``what`` names it in
    the error."""
    for directory in (path.parent, path):
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(directory, 0o700)
        why = unsafe_parent(directory)
        if why is not None:
            raise UsageError(f"{what}: {directory} is not safe: {why}")
    try:
        fd = os.open(path, DIR_FLAGS)
    except FileNotFoundError:
        if create:
            raise UsageError(f"{what}: cannot open {path} (it went as it was made)") from None
        raise
    except OSError as e:
        raise UsageError(f"{what}: cannot open {path} ({e.strerror or e})") from None
    why = not_private(os.fstat(fd), unreadable=True)
    if why is not None:
        os.close(fd)
        raise UsageError(f"{what}: {path} {why}: remove it")
    return fd


def pid_of(text: str) -> int:
    """The process id a name carries (0, never alive, for one that carries none)."""
    return int(text) if text.isdigit() else 0


def alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive, never ours to remove
        return True
    return True
