"""Hold one process (a straggler) to a share of a core.

Preferred: a CPU cgroup of its own with a CFS quota (cgroup v2 ``cpu.max`` "50000 100000", or
v1 ``cpu.cfs_quota_us``/``cpu.cfs_period_us``), the process moved in; on close it is moved
back to the cgroup it came from and the cgroup removed, whatever happened. Where no cgroup is
writable: SIGSTOP/SIGCONT duty cycling from a thread (e.g. 50 ms running, 50 ms stopped),
through a pidfd so a recycled PID is never signalled, and always a last SIGCONT.

    with throttle(pid, share=0.5) as t:     # t.method: cgroup2, cgroup1 or sigstop
        ...

Only processes the harness started are passed in; cgroups it creates are named
``psserver-bench-<harness pid>-<n>``, and ``cleanup_stale`` removes those whose harness is gone.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "psserver-bench-"
PERIOD_US = 100_000
METHODS = ("auto", "cgroup", "cgroup2", "cgroup1", "sigstop")
_counter = itertools.count()


def _mounts() -> list[tuple[str, str, list[str]]]:
    """(mount point, fs type, options) of the cgroup file systems."""
    out = []
    try:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
                out.append((parts[1].replace("\\040", " "), parts[2], parts[3].split(",")))
    except OSError:
        pass
    return out


def _own_cgroup(version: int, controller: str = "cpu") -> str:
    """This process's cgroup path in the v2 hierarchy (``version`` 2) or the v1 ``cpu`` one."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hid, ctrls, path = line.split(":", 2)
            if version == 2 and hid == "0" and ctrls == "":
                return path
            if version == 1 and controller in ctrls.split(","):
                return path
    except (OSError, ValueError):
        pass
    return "/"


def cgroup_parents() -> list[tuple[str, Path]]:
    """Where a child cgroup with a CPU quota can be made, best first: ("cgroup2", dir) where the
    ``cpu`` controller is enabled for children, ("cgroup1", dir) in a v1 ``cpu`` hierarchy."""
    out = []
    for mnt, fstype, _ in _mounts():
        if fstype == "cgroup2":
            for rel in dict.fromkeys([_own_cgroup(2), "/"]):
                d = Path(mnt) / rel.lstrip("/")
                try:
                    if "cpu" in (d / "cgroup.subtree_control").read_text().split() and os.access(d, os.W_OK):
                        out.append(("cgroup2", d))
                except OSError:
                    continue
    for mnt, fstype, opts in _mounts():
        if fstype == "cgroup" and "cpu" in opts:
            for rel in dict.fromkeys([_own_cgroup(1), "/"]):
                d = Path(mnt) / rel.lstrip("/")
                if (d / "cpu.cfs_quota_us").exists() and os.access(d, os.W_OK):
                    out.append(("cgroup1", d))
    return out


class CgroupThrottle:
    """A cgroup of its own with a CPU quota of ``share`` cores; ``close`` moves the process
    back and removes the cgroup (``OSError`` from the constructor: nothing is left behind)."""

    def __init__(self, pid: int, share: float, version: str, parent: Path) -> None:
        self.pid, self.share, self.method, self.parent = pid, share, version, parent
        self.path = parent / f"{PREFIX}{os.getpid()}-{next(_counter)}"
        self.origin = self._origin(pid)
        self.path.mkdir()
        try:
            quota = max(1000, int(share * PERIOD_US))
            if version == "cgroup2":
                (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
            (self.path / "cgroup.procs").write_text(str(pid))
        except BaseException:
            self.close()
            raise

    def _origin(self, pid: int) -> Path:
        """The cgroup ``pid`` is in now (where ``close`` puts it back), in this hierarchy."""
        mnt = self.parent
        want = "0" if self.method == "cgroup2" else None
        try:
            for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
                hid, ctrls, path = line.split(":", 2)
                if (want is not None and hid == want and ctrls == "") or (want is None and "cpu" in ctrls.split(",")):
                    root = self._mount_root()
                    return root / path.lstrip("/")
        except (OSError, ValueError):
            pass
        return mnt

    def _mount_root(self) -> Path:
        for mnt, fstype, opts in _mounts():
            if str(self.parent).startswith(mnt) and (fstype == "cgroup2") == (self.method == "cgroup2") \
                    and (fstype == "cgroup2" or "cpu" in opts):
                return Path(mnt)
        return self.parent

    def procs(self) -> list[int]:
        try:
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def close(self) -> None:
        """Move what is left in the cgroup back to where the process came from; remove it."""
        for _ in range(50):
            if not self.path.exists():
                return
            for pid in self.procs():
                for dest in (self.origin, self.parent):
                    try:
                        (dest / "cgroup.procs").write_text(str(pid))
                        break
                    except OSError:
                        continue
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # busy: a process still leaving
                time.sleep(0.02)
        log.warning("could not remove cgroup %s", self.path)


class DutyCycleThrottle:
    """SIGSTOP/SIGCONT duty cycling: ``share`` of every ``period_s`` running, the rest stopped."""

    method = "sigstop"

    def __init__(self, pid: int, share: float, period_s: float = 0.1) -> None:
        self.pid, self.share = pid, share
        self.on_s, self.off_s = share * period_s, (1 - share) * period_s
        self._fd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"throttle-{pid}", daemon=True)
        self._thread.start()

    def _signal(self, sig: int) -> bool:
        try:
            if self._fd is not None:
                signal.pidfd_send_signal(self._fd, sig)
            else:
                os.kill(self.pid, sig)
            return True
        except (ProcessLookupError, PermissionError, OSError):
            return False

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.on_s):
                if not self._signal(signal.SIGSTOP):
                    return
                self._stop.wait(self.off_s)
                if not self._signal(signal.SIGCONT):
                    return
        finally:
            self._signal(signal.SIGCONT)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._signal(signal.SIGCONT)
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def start(pid: int, share: float = 0.5, method: str = "auto") -> CgroupThrottle | DutyCycleThrottle:
    """Hold ``pid`` to ``share`` cores with ``method`` (``auto``: a cgroup where one is
    writable, else SIGSTOP/SIGCONT). ``close()`` the result (or use ``throttle``)."""
    if method not in METHODS:
        raise ValueError(f"unknown throttle method {method!r}; known: {', '.join(METHODS)}")
    if not 0 < share < 1:
        raise ValueError(f"CPU share must be in (0, 1), got {share}")
    if method == "sigstop":
        return DutyCycleThrottle(pid, share)
    errors = []
    for version, parent in cgroup_parents():
        if method in ("cgroup2", "cgroup1") and version != method:
            continue
        try:
            return CgroupThrottle(pid, share, version, parent)
        except OSError as e:
            errors.append(f"{parent}: {e}")
    if method != "auto":
        raise OSError(f"no writable {method if method != 'cgroup' else 'CPU cgroup'}: "
                      + ("; ".join(errors) or "none mounted with the cpu controller"))
    if errors:
        log.info("no CPU cgroup usable (%s): SIGSTOP/SIGCONT duty cycling", "; ".join(errors))
    return DutyCycleThrottle(pid, share)


@contextlib.contextmanager
def throttle(pid: int, share: float = 0.5, method: str = "auto"):
    t = start(pid, share, method)
    try:
        yield t
    finally:
        t.close()


def cgroup_available() -> str | None:
    """The cgroup flavour ``start`` would use (``cgroup2``/``cgroup1``), or None."""
    parents = cgroup_parents()
    return parents[0][0] if parents else None


def cleanup_stale() -> list[Path]:
    """Remove empty ``psserver-bench-<pid>-*`` cgroups whose harness process is gone."""
    removed = []
    for _, parent in cgroup_parents():
        for d in parent.glob(f"{PREFIX}*"):
            try:
                owner = int(d.name[len(PREFIX):].split("-")[0])
            except ValueError:
                continue
            if owner == os.getpid() or Path(f"/proc/{owner}").exists():
                continue
            with contextlib.suppress(OSError):
                d.rmdir()
                removed.append(d)
    return removed
