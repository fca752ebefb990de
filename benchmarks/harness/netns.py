"""A network namespace of the harness's own, so the bytes a setup puts on the wire are counted
exactly: the PS server, its trainers and the DDP ranks run in it (``ip netns exec``), talk over
its loopback only (127.0.0.1, the namespace's own), and the loopback's counters
(``/proc/<pid in it>/net/dev``) hold their traffic and nothing else: no other process of this
machine can add to them. Every packet on a loopback is sent once and received once, so the
transmitted bytes are the bytes on the wire (TCP/IP headers included).

    with NetNamespace.create() as ns:
        child = subprocess.Popen(ns.wrap(argv))        # ip netns exec psbench-<pid>-<n> argv...
        before = ns.tx_bytes(); ...; after = ns.tx_bytes()

The namespace is deleted on close (and a process left in it keeps it alive only until it
exits); ``cleanup_stale`` deletes ``psbench-<pid>-*`` namespaces whose harness is gone. Needs
root and iproute2: ``available()`` says why not, and the harness falls back to ``ss``.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import subprocess
import time
from pathlib import Path

PREFIX = "psbench-"
_counter = itertools.count()


def parse_net_dev(text: str, interface: str = "lo") -> tuple[int, int]:
    """(received, transmitted) bytes of ``interface`` in ``/proc/net/dev`` text."""
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        if sep and name.strip() == interface:
            fields = rest.split()
            return int(fields[0]), int(fields[8])
    raise ValueError(f"no interface {interface!r} in /proc/net/dev")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def available() -> str | None:
    """None when a namespace can be made here, else why not."""
    if shutil.which("ip") is None:
        return "no ip command (iproute2)"
    if os.geteuid() != 0:
        return "not root"
    return None


class NetNamespace:
    """One network namespace with its loopback up and a sleeping anchor process in it (whose
    ``/proc/<pid>/net/dev`` is read, no process spawned per reading)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.anchor: subprocess.Popen | None = None

    @classmethod
    def create(cls, name: str | None = None) -> NetNamespace:
        reason = available()
        if reason:
            raise OSError(f"cannot create a network namespace: {reason}")
        ns = cls(name or f"{PREFIX}{os.getpid()}-{next(_counter)}")
        r = _ip("netns", "add", ns.name, check=False)
        if r.returncode != 0:
            raise OSError(f"ip netns add {ns.name}: {r.stderr.strip() or r.returncode}")
        try:
            _ip("-n", ns.name, "link", "set", "lo", "up")
            ns.anchor = subprocess.Popen(ns.wrap(["sleep", "infinity"]), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                         start_new_session=True)
            ns._wait_anchor_inside()
            ns.tx_bytes()  # readable, or fail now
        except BaseException:
            ns.close()
            raise
        return ns

    def _wait_anchor_inside(self, timeout: float = 10.0) -> None:
        """Until ``ip netns exec`` has moved the anchor in (before, its counters are the host's)."""
        want = None
        for d in ("/run/netns", "/var/run/netns"):
            with contextlib.suppress(OSError):
                want = os.stat(Path(d, self.name)).st_ino
                break
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                if want is not None and os.stat(f"/proc/{self.anchor.pid}/ns/net").st_ino == want:
                    return
            if self.anchor.poll() is not None or time.monotonic() > deadline:
                raise OSError(f"the anchor process never entered network namespace {self.name}")
            time.sleep(0.01)

    def shape(self, qdisc: list[str]) -> None:
        """``tc qdisc add dev lo root QDISC`` in the namespace (``tbf rate 1gbit ...``, or
        ``netem delay 2ms`` where the kernel has netem): every packet between its processes
        goes through it, as between hosts."""
        r = subprocess.run(["ip", "netns", "exec", self.name, "tc", "qdisc", "add", "dev", "lo", "root", *qdisc],
                           capture_output=True, text=True, timeout=30, check=False)
        if r.returncode != 0:
            raise OSError(f"tc qdisc {' '.join(qdisc)}: {r.stderr.strip() or r.returncode}")

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec`` execs it: same PID)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def counters(self) -> tuple[int, int]:
        """(received, transmitted) bytes of the namespace's loopback so far."""
        if self.anchor is None or self.anchor.poll() is not None:
            raise OSError(f"the anchor process of namespace {self.name} is gone")
        return parse_net_dev(Path(f"/proc/{self.anchor.pid}/net/dev").read_text())

    def tx_bytes(self) -> int:
        return self.counters()[1]

    def close(self) -> None:
        if self.anchor is not None:
            if self.anchor.poll() is None:
                self.anchor.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.anchor.wait(10)
            self.anchor = None
        _ip("netns", "delete", self.name, check=False)

    def __enter__(self) -> NetNamespace:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def exists(name: str) -> bool:
    return Path("/var/run/netns", name).exists() or Path("/run/netns", name).exists()


def cleanup_stale() -> list[str]:
    """Delete ``psbench-<pid>-*`` namespaces whose harness process is gone."""
    if available():
        return []
    removed = []
    r = _ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        try:
            owner = int(name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if owner != os.getpid() and not Path(f"/proc/{owner}").exists():
            _ip("netns", "delete", name, check=False)
            removed.append(name)
    return removed
