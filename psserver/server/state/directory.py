"""The state directory's files, opened so that no other local user can steer them.

The state in memory lives in a directory that anyone may know the name of (``/dev/shm`` is
writable by every user). What the server reads there decides the parameters it trains on, and
what it writes there it writes as its own user (often root). So:

- the directory is the server's own: created with mode 0700, and refused when it exists owned
  by another user or writable by its group or others (whoever could write it could plant a
  state, or a symbolic link that makes the server overwrite a file elsewhere), or when a
  directory above it would let another user replace it (``psserver.utils.private_paths``);
- every directory below it is opened relative to its parent's descriptor without following
  symbolic links (``O_NOFOLLOW``, ``dir_fd``), and checked the same way;
- files are created ``O_EXCL | O_NOFOLLOW`` with mode 0600, replaced by a rename inside their
  directory, read only when they are regular files of this user of a bounded size;
- removal never follows a symbolic link: a link is removed, never what it points at.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
from pathlib import Path

from psserver.errors import UsageError
from psserver.utils.private_paths import DIR_FLAGS, not_private, unsafe_parent

FILE_MODE, DIR_MODE = 0o600, 0o700


class MemoryStateError(UsageError):
    """A segment that cannot be used (its files are torn, of another format, or not this user's)."""


def _trusted(st: os.stat_result, what: Path) -> None:
    """``what`` (described by ``st``) belongs to this user and nobody else can write it."""
    why = not_private(st)
    if why is not None:
        raise MemoryStateError(f"{what} {why}: another user may have made it or may change it; remove it or "
                               "chmod go-w it, or give --state-dir a directory of your own")


def open_root(root: Path, create: bool) -> int | None:
    """A descriptor of the state directory ``root``, created (mode 0700) when ``create`` and
    missing; None when it is missing and not created. ``MemoryStateError`` when it is a
    symbolic link, another user's, or writable by others."""
    why = unsafe_parent(root)
    if why is not None:
        raise MemoryStateError(f"--state-dir {root}: {why}; give --state-dir a directory of your own")
    if create:
        try:
            root.parent.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise MemoryStateError(f"--state-dir {root}: cannot make {root.parent}: it, or a directory above it, is "
                                   "a file") from None
        except OSError as e:  # a loop of links, no permission
            raise MemoryStateError(f"--state-dir {root}: cannot make {root.parent} ({e.strerror or e})") from None
        why = unsafe_parent(root)  # again: a parent another user made while these were made is theirs
        if why is not None:
            raise MemoryStateError(f"--state-dir {root}: {why}; give --state-dir a directory of your own")
    return _open_trusted(str(root), None, root, f"--state-dir {root}", create)


def open_dir(parent: int, name: str, where: Path, create: bool) -> int | None:
    """A descriptor of ``name`` in the directory ``parent`` (which is ``where``), created
    (mode 0700) when ``create``; None when it is missing and not created."""
    return _open_trusted(name, parent, where / name, str(where / name), create)


def _open_trusted(name: str, parent: int | None, path: Path, what: str, create: bool) -> int | None:
    """``name`` (in ``parent``, else as a path) opened as a directory without following a link,
    made 0700 when ``create``, and checked to be this user's alone (``_trusted``)."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, DIR_MODE, dir_fd=parent)
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        if create:
            raise MemoryStateError(f"{what}: it went while it was being made") from None
        return None
    except OSError as e:
        raise MemoryStateError(f"{what}: cannot open it ({_why(e, path.name, parent)})") from None
    try:
        _trusted(os.fstat(fd), path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def subdirs(fd: int) -> list[str]:
    """The names of the real directories in ``fd`` (symbolic links are not directories here), sorted."""
    with os.scandir(fd) as it:
        return sorted(e.name for e in it if e.is_dir(follow_symlinks=False))


def files(fd: int, prefix: str = "", suffix: str = "") -> list[str]:
    """The names of the regular files (not links) in ``fd`` that start and end so, sorted."""
    with os.scandir(fd) as it:
        return sorted(e.name for e in it
                      if e.name.startswith(prefix) and e.name.endswith(suffix) and e.is_file(follow_symlinks=False))


def write_file(fd: int, name: str, data: bytes) -> None:
    """``name`` in ``fd`` replaced atomically by ``data`` (mode 0600): written to a temporary
    created ``O_EXCL | O_NOFOLLOW`` (whatever held that name is removed first, never followed)."""
    tmp = f"{name}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp, dir_fd=fd)
    out = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(out, view):]
    finally:
        os.close(out)
    os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)


def open_file(fd: int, name: str, where: Path, flags: int = os.O_RDONLY) -> int | None:
    """A descriptor of the regular file ``name`` in ``fd`` (``where``), this user's and
    writable by nobody else; None when it is missing. ``MemoryStateError`` otherwise."""
    try:
        # O_NONBLOCK: a FIFO planted under the name is opened (and refused below), not waited on.
        f = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=fd)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise MemoryStateError(f"{where / name}: cannot open it ({_why(e, name, fd)})") from None
    try:
        st = os.fstat(f)
        if not stat.S_ISREG(st.st_mode):
            raise MemoryStateError(f"{where / name} is not a regular file")
        _trusted(st, where / name)
    except BaseException:
        os.close(f)
        raise
    return f


def read_file(fd: int, name: str, where: Path, limit: int) -> bytes | None:
    """The bytes of ``name`` (see ``open_file``), at most ``limit`` of them (a longer file is
    refused before anything is read); None when it is missing."""
    f = open_file(fd, name, where)
    if f is None:
        return None
    try:
        size = os.fstat(f).st_size
        if size > limit:
            raise MemoryStateError(f"{where / name}: {size} bytes, more than the {limit} such a file may hold")
        chunks, left = [], size
        while left > 0:
            chunk = os.read(f, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(f)


def unlink(fd: int, name: str) -> None:
    """``name`` in ``fd`` removed, if there (a link itself, never what it points at)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=fd)


def remove_tree(fd: int, name: str) -> None:
    """The directory ``name`` in ``fd`` and all below it, without following any symbolic link
    (a link named ``name`` is removed itself); errors are ignored, as a cleanup's are."""
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(name, ignore_errors=True, dir_fd=fd)  # (the descriptor-relative walk: links are not followed)
    else:
        with contextlib.suppress(OSError):
            os.unlink(name, dir_fd=fd)


def rmdir(fd: int, name: str) -> None:
    """The empty directory ``name`` in ``fd`` removed, if it is empty (else left)."""
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=fd)


def _why(e: OSError, name: str, dir_fd: int | None) -> str:
    """Why ``name`` (in ``dir_fd``; a path when None) would not open: a link is named as one."""
    with contextlib.suppress(OSError):
        if stat.S_ISLNK(os.stat(e.filename if dir_fd is None else name, dir_fd=dir_fd, follow_symlinks=False).st_mode):
            return "a symbolic link, not followed"
    if e.errno == errno.ENOTDIR:
        return "not a directory"
    return e.strerror or str(e)
