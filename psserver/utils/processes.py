"""Whether a process of this host still runs, told apart from one that reused its pid."""

from __future__ import annotations

import os
from pathlib import Path


def pid_alive(pid: int | None) -> bool:
    """A process with ``pid`` exists (someone else's counts)."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def start_time(pid: int | None) -> int | None:
    """The process's start time in clock ticks since boot (a reused pid has another); None: unknown."""
    if pid is None:
        return None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def running(pid: int | None, start: int | None) -> bool:
    """``pid`` runs and is the process that started at ``start`` (None: not recorded)."""
    return pid_alive(pid) and (start is None or start_time(pid) in (None, start))


def boot_id() -> str | None:
    """The kernel's boot id: what a pid or a host name alone cannot tell, whether this is the
    same boot of the same host (None where the kernel does not say)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None
