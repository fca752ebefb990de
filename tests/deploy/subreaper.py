"""``python subreaper.py CMD...``: runs CMD (a Slurm daemon) as a child subreaper's child.

slurmd's ``slurmstepd`` processes (and the tasks they start) outlive their parent's wait: orphans
go to PID 1, which on these machines never reaps them, so they would stay behind as zombies.
Here they come to this process instead, which reaps them. SIGTERM/SIGINT go to CMD; once CMD
has exited, whatever of its descendants is left gets SIGTERM, then SIGKILL after 10 s, and this
process exits with CMD's code when all are gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def children() -> list[int]:
    """PIDs whose parent is this process (orphans included)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == me:
            found.append(int(entry))
    return found


def reap(keep: int) -> None:
    """Reaps every exited child but ``keep`` (the daemon: Popen waits for that one)."""
    for pid in children():
        if pid != keep:
            try:
                os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                pass


def main() -> int:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    daemon = subprocess.Popen(sys.argv[1:])
    signal.signal(signal.SIGTERM, lambda *_: daemon.send_signal(signal.SIGTERM))
    signal.signal(signal.SIGINT, lambda *_: daemon.send_signal(signal.SIGTERM))
    while daemon.poll() is None:
        reap(daemon.pid)
        time.sleep(0.2)
    deadline, sig = time.monotonic() + 10, signal.SIGTERM
    while left := children():
        if time.monotonic() > deadline:
            sig = signal.SIGKILL
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(0.2)
        reap(daemon.pid)
    return daemon.returncode


if __name__ == "__main__":
    sys.exit(main())
