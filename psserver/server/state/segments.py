"""The segments under a state directory, whoever's run they hold: which are in use, which
were left by a job that is gone (stale). Found without following a symbolic link."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from psserver.server.state import directory as sd
from psserver.server.state.directory import MemoryStateError
from psserver.server.state.meta import MAX_OWNER_BYTES, parse_owner
from psserver.utils.processes import boot_id, running

log = logging.getLogger(__name__)

OWNER = "owner.json"


@dataclass
class Segment:
    """One server process's state in ``--state-dir``."""

    path: Path
    key: str
    owner: dict | None
    """What its ``owner.json`` says (None: missing, or not what a server writes)."""

    @property
    def alive(self) -> bool:
        """Whether a process that owns it still runs on this host (since this boot)."""
        o = self.owner
        if not o or o.get("boot_id") != boot_id():
            return False
        return any(running(pid, start) for pid, start in ((o.get("pid"), o.get("pid_start")),
                                                            (o.get("supervisor"), o.get("supervisor_start"))))

    @property
    def nbytes(self) -> int:
        total = 0
        for f in self.path.glob("tensors-*.bin"):
            with contextlib.suppress(OSError):
                total += f.lstat().st_size
        return total

    def describe(self) -> str:
        o = self.owner
        if o is None:
            return f"{self.path} ({self.nbytes / 2**20:.1f} MiB, its {OWNER} missing or unreadable)"
        return (f"{self.path} ({self.nbytes / 2**20:.1f} MiB, run {o.get('run') or '?'}, left by pid "
                f"{o.get('pid') or '?'} on {time.strftime('%Y-%m-%d %H:%M', time.localtime(o['started']))})")


def scan(root: Path) -> list[Segment]:
    """Every segment under ``root`` (whatever its key); no symbolic link is followed, and a key's
    directory that is not this user's alone is left out. ``MemoryStateError`` when ``root`` is
    not this user's alone."""
    fd = sd.open_root(root, create=False)
    if fd is None:
        return []
    try:
        return scan_open(fd, root)
    finally:
        os.close(fd)


def scan_open(fd: int, root: Path) -> list[Segment]:
    """``scan`` of the directory ``root`` already open as ``fd`` (checked by whoever opened it)."""
    out = []
    for key in sd.subdirs(fd):
        try:
            key_fd = sd.open_dir(fd, key, root, create=False)
        except MemoryStateError as e:
            log.warning("left alone: %s", e)
            continue
        if key_fd is None:
            continue
        try:
            for name in sd.subdirs(key_fd):
                if not name.startswith("server-"):
                    continue
                owner = None
                with contextlib.suppress(MemoryStateError):
                    seg_fd = sd.open_dir(key_fd, name, root / key, create=False)
                    if seg_fd is not None:
                        try:
                            owner = parse_owner(sd.read_file(seg_fd, OWNER, root / key / name, MAX_OWNER_BYTES))
                        finally:
                            os.close(seg_fd)
                out.append(Segment(root / key / name, key, owner))
        finally:
            os.close(key_fd)
    return out
