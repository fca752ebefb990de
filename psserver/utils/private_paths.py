"""Paths only this user can change: a server's state directory, the control token's directory,
the checkpoints a resume trusts.

A directory is this user's alone when it is theirs and nobody else can write it, and when no
directory above it lets another user rename it away and put their own in its place (each one
root's or this user's, writable by others only with the sticky bit: ``/tmp``, ``/dev/shm``),
as OpenSSH checks the path to ``authorized_keys``. Callers open the directory with
``O_NOFOLLOW`` and check the descriptor (:func:`not_private`), so the check is of what they use.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def not_private(st: os.stat_result, *, unreadable: bool = False) -> str | None:
    """Why what ``st`` describes is not this user's alone (``unreadable``: nor hidden from
    others), else None; the reason reads after the path ("... is owned by uid 1001, ...")."""
    uid = os.geteuid()
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by this user (uid {uid})"
    if st.st_mode & 0o022:
        return f"is writable by its group or others (mode {stat.S_IMODE(st.st_mode):03o})"
    if unreadable and st.st_mode & 0o077:
        return f"is readable by others (mode {stat.S_IMODE(st.st_mode):03o})"
    return None


MAX_LINKS = 40
"""Symbolic links followed in one path, as the kernel's limit (``ELOOP``)."""


def unsafe_parent(path: Path) -> str | None:
    """Why a directory above ``path`` would let another user replace it, else None: the first
    such directory (or symbolic link on the way to it) and what is wrong with it. The path is
    walked as the kernel walks it, one link at a time (a link first, then ``..`` from where it
    points; never ``..`` taken off the text), its last component too when that is a link, and
    every directory it passes through is checked, those above each link's target too: a link
    must be root's or this user's (its owner can point it elsewhere), the links it leads to as
    well. ``path`` itself, once reached, is the caller's to check."""
    uid = os.geteuid()
    given = Path(path)
    full = given if given.is_absolute() else Path(os.getcwd()) / given
    pending = list(full.parts[1:])
    passed: list[Path] = [Path("/")]
    current = Path("/")
    links = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        candidate = current / part
        try:
            st = os.lstat(candidate)
        except OSError:  # not there yet: this user makes it; the walk goes on (a '..' after it, say)
            current = candidate
            continue
        if stat.S_ISLNK(st.st_mode):
            if st.st_uid not in (0, uid):
                return f"{candidate}, on the way to it, is a link of uid {st.st_uid}: that user can point it elsewhere"
            links += 1
            try:
                target = Path(os.readlink(candidate))
            except OSError as e:
                return f"{candidate}, on the way to it, cannot be read ({e.strerror or e})"
            if links > MAX_LINKS:
                return f"{candidate}, on the way to it: too many levels of symbolic links"
            if target.is_absolute():
                current = Path("/")
            pending[:0] = list(target.parts[1:] if target.is_absolute() else target.parts)
            continue
        current = candidate
        if pending:
            passed.append(current)
    for directory in dict.fromkeys(passed):
        try:
            st = os.stat(directory)
        except OSError:
            continue
        if st.st_uid not in (0, uid):
            return f"{directory}, above it, is owned by uid {st.st_uid}: that user can replace what is in it"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"{directory}, above it, is writable by its group or others without the sticky bit "
                    f"(mode {stat.S_IMODE(st.st_mode):o}): another user can replace what is in it")
    return None


def untrusted_file(path: Path) -> str | None:
    """Why the file at ``path`` (not followed if a link) is not one this user wrote and only
    this user can change, else None. Root's files are trusted too."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a link, a FIFO?)"
    if st.st_uid not in (0, os.geteuid()):
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"is writable by its group or others (mode {stat.S_IMODE(st.st_mode):03o})"
    return None
