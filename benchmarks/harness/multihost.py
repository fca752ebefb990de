"""Several hosts on one machine: network namespaces behind rate-limited links to one switch.

Each node is a network namespace of its own with one interface, ``eth0``, the end of a veth
pair whose other end (``v<k>``) is a port of a Linux bridge in a hub namespace; the harness
creates all of them and never touches the root namespace's interfaces, addresses or routes
(both veth ends are created inside namespaces: ``ip -n HUB link add v<k> type veth peer name
eth0 netns NODE``). Node ``k`` gets ``10.x.y.(k+1)/24`` on a private /24 the harness picks; the
only route in a node is that subnet's, so its traffic can go to the assigned addresses and
nowhere else (the hub has no address at all, IPv6 is off on every link). Each link is limited
in BOTH directions with ``tc`` (egress of ``eth0`` in the node: what the node sends; egress of
``v<k>`` in the hub: what it receives), so every node sees a full-duplex link of the given rate
(``tbf`` by default, ``htb`` on request), as hosts behind one switch do. Loopback is up
everywhere.

    with Topology(4, rate_mbit=100) as topo:
        server = subprocess.Popen(topo.wrap(0, ["python", "-m", "psserver", "serve", "--host",
                                               topo.address(0), ...]))     # ip netns exec ...
        before = topo.counters(); ...; after = topo.counters()           # bytes per node

Byte counters come from the hub side: ``/proc/<anchor>/net/dev`` of a sleeping process in the
hub (one read, every port; the same numbers as ``/sys/class/net/v<k>/statistics`` seen from
inside the hub). Port ``v<k>``'s received bytes are what node ``k`` sent, its transmitted bytes
what node ``k`` received; ``counters()`` returns them from the node's side (``Link.rx``,
``Link.tx``), Ethernet/IP/TCP headers included.

Names: ``psbench-<pid>-m<n>-hub`` and ``psbench-<pid>-m<n>-<k>`` (``<pid>``: the harness's), so
``cleanup_stale()`` (and ``benchmarks.harness.netns.cleanup_stale``) can delete what a harness that died
left behind. ``close()`` (the context manager's exit) deletes every link and namespace it made,
whatever happened; processes still running in a node keep only an isolated, unnamed namespace
alive until they exit (their link is gone with the hub). Needs root, iproute2 (``ip``) and
``tc``: ``available()`` says why not, after a real probe.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import netns
from psserver.config.common import JOIN_TOKEN_ENV

PREFIX = netns.PREFIX
"""``psbench-``: shared with ``benchmarks.harness.netns``, whose ``cleanup_stale`` reads the same ``<pid>``."""
NODE_IF = "eth0"
BRIDGE = "br0"
QDISCS = ("tbf", "htb")
_counter = itertools.count()
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d+)-m\d+-(hub|\d+|probe)$")


def _run(argv: list[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and r.returncode != 0:
        raise OSError(f"{' '.join(argv)}: {r.stderr.strip() or f'exit code {r.returncode}'}")
    return r


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["ip", *args], check=check)


def _tc(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return _run(["tc", *args], check=check)


def _netns_list() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines() if line.split()]


def owner_pid(name: str) -> int | None:
    """The harness pid in a name this module gives a namespace (None: not one of ours)."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def subnet_for(pid: int, seq: int) -> str:
    """The private /24 of topology ``seq`` of harness ``pid``: ``10.x.y.0/24`` with x in
    100..227 and y from the pid, so that two harnesses rarely pick the same one (even then they
    would not meet: each topology is a separate, isolated set of namespaces)."""
    return f"10.{100 + (pid // 256 + 7 * seq) % 128}.{pid % 256}.0/24"


def shape_commands(dev: str, rate_mbit: float, qdisc: str = "tbf") -> list[list[str]]:
    """``tc`` arguments (without ``-n NS``) that hold ``dev``'s egress to ``rate_mbit`` Mbit/s.

    tbf: a bucket of 2 ms at the rate (at least 32 KiB, so a full-size segment always fits;
    bigger GSO packets are segmented by tbf itself) and up to 100 ms of queue, as a switch port
    buffers. htb: one class at rate = ceil, pfifo under it (``default 1``: everything in it)."""
    if qdisc not in QDISCS:
        raise ValueError(f"unknown qdisc {qdisc!r}; known: {', '.join(QDISCS)}")
    if rate_mbit <= 0:
        raise ValueError(f"rate must be > 0 Mbit/s, got {rate_mbit}")
    kbit = max(8, round(rate_mbit * 1000))
    rate_bytes = kbit * 1000 / 8
    burst = max(32 * 1024, int(rate_bytes * 0.002))
    if qdisc == "tbf":
        limit = max(4 * burst, int(rate_bytes * 0.1))
        return [["qdisc", "replace", "dev", dev, "root", "handle", "1:", "tbf", "rate", f"{kbit}kbit",
                 "burst", str(burst), "limit", str(limit)]]
    quantum = min(200_000, max(1514, int(rate_bytes / 1000)))
    return [["qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1"],
            ["class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", f"{kbit}kbit",
             "ceil", f"{kbit}kbit", "burst", str(burst), "cburst", str(burst), "quantum", str(quantum)]]


def _delete_namespace_links(name: str) -> None:
    """Delete every link but ``lo`` in namespace ``name`` (a veth takes its peer along)."""
    r = _ip("-n", name, "-o", "link", "show", check=False)
    for line in r.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) < 2:
            continue
        dev = parts[1].strip().split("@")[0]
        if dev and dev != "lo":
            _ip("-n", name, "link", "delete", dev, check=False)


def _delete_namespace(name: str) -> None:
    _delete_namespace_links(name)
    _ip("netns", "delete", name, check=False)


@functools.cache
def _probe() -> str | None:
    """Build a namespace with a bridge, a veth pair on it and a ``tc`` shaper, then delete it."""
    name = f"{PREFIX}{os.getpid()}-m{next(_counter)}-probe"
    try:
        _ip("netns", "add", name)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create a network namespace: {e}"
    try:
        _ip("-n", name, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", name, "link", "add", "pa", "type", "veth", "peer", "name", "pb")
        _ip("-n", name, "link", "set", "pa", "master", BRIDGE)
        for cmd in shape_commands("pb", 10.0):
            _tc("-n", name, *cmd)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"probe failed: {e}"
    finally:
        _delete_namespace(name)
    return None


def available() -> str | None:
    """None when a topology can be built here, else why not (not root, no ``ip``, no ``tc``, or
    the probe, a bridge, a veth pair and a ``tc`` shaper in a throwaway namespace, failed)."""
    if os.geteuid() != 0:
        return "not root (network namespaces, veth pairs and tc need CAP_NET_ADMIN)"
    if shutil.which("ip") is None:
        return "no ip command (iproute2)"
    if shutil.which("tc") is None:
        return "no tc command (iproute2)"
    return _probe()


def cleanup_stale() -> list[str]:
    """Delete the namespaces (and their links) of topologies whose harness process is gone."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return []
    removed = []
    for name in _netns_list():
        owner = owner_pid(name)
        if owner is None or owner == os.getpid() or Path(f"/proc/{owner}").exists():
            continue
        _delete_namespace(name)
        removed.append(name)
    return removed


@dataclass(frozen=True)
class Link:
    """Bytes one node has sent (``tx``) and received (``rx``) over its link, headers included."""

    rx: int
    tx: int

    @property
    def total(self) -> int:
        return self.rx + self.tx


def _parse_all(text: str) -> dict[str, tuple[int, int]]:
    """(rx, tx) bytes of every interface in ``/proc/net/dev`` text."""
    out = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        fields = rest.split()
        if sep and len(fields) >= 9:
            out[name.strip()] = (int(fields[0]), int(fields[8]))
    return out


class Topology:
    """``nodes`` hosts behind a switch, every link limited to ``rate_mbit`` Mbit/s each way
    (None: no limit). Built in the constructor (``OSError``: nothing is left behind);
    ``close()`` (or leaving the ``with`` block) removes everything."""

    def __init__(self, nodes: int, rate_mbit: float | None, *, qdisc: str = "tbf", subnet: str | None = None,
                 delay_ms: float = 0.0) -> None:
        if not 1 <= nodes <= 250:
            raise ValueError(f"nodes must be in 1..250, got {nodes}")
        if qdisc not in QDISCS:
            raise ValueError(f"unknown qdisc {qdisc!r}; known: {', '.join(QDISCS)}")
        reason = available()
        if reason:
            raise OSError(f"cannot build a multi-host topology: {reason}")
        seq = next(_counter)
        self.prefix = f"{PREFIX}{os.getpid()}-m{seq}"
        self.subnet = subnet or subnet_for(os.getpid(), seq)
        m = re.fullmatch(r"(\d+)\.(\d+)\.(\d+)\.0/24", self.subnet)
        if not m:
            raise ValueError(f"subnet must be a /24 written A.B.C.0/24, got {self.subnet!r}")
        self._net = ".".join(m.groups())
        self.size, self.rate_mbit, self.qdisc, self.delay_ms = nodes, rate_mbit, qdisc, delay_ms
        self.join_token = secrets.token_hex(16)
        """The join token of every psserver process run in a node (``wrap``)."""
        self.hub_name = f"{self.prefix}-hub"
        self.names = [f"{self.prefix}-{k}" for k in range(nodes)]
        self.hub: netns.NetNamespace | None = None
        self._made: list[str] = []
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    # ---- building -----------------------------------------------------------------------

    def _add_namespace(self, name: str) -> None:
        if netns.exists(name):
            raise OSError(f"network namespace {name} exists already")
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _shape(self, ns: str, dev: str) -> None:
        if self.rate_mbit is None:
            if self.delay_ms:
                _tc("-n", ns, "qdisc", "replace", "dev", dev, "root", "netem", "delay", f"{self.delay_ms}ms")
            return
        for cmd in shape_commands(dev, self.rate_mbit, self.qdisc):
            _tc("-n", ns, *cmd)
        if self.delay_ms:  # a fixed one-way delay under the shaper
            parent = "1:1" if self.qdisc == "htb" else "1:"
            _tc("-n", ns, "qdisc", "replace", "dev", dev, "parent", parent, "handle", "10:", "netem", "delay",
                f"{self.delay_ms}ms", "limit", "100000")

    def _build(self) -> None:
        # The hub: a namespace with a sleeping anchor whose /proc/<pid>/net/dev holds the ports' counters.
        self.hub = netns.NetNamespace.create(self.hub_name)
        self._made.append(self.hub_name)
        hub = self.hub_name
        _ip("-n", hub, "link", "add", BRIDGE, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        _ip("-n", hub, "link", "set", BRIDGE, "addrgenmode", "none")
        _ip("-n", hub, "link", "set", BRIDGE, "up")
        for k, name in enumerate(self.names):
            self._add_namespace(name)
            port = self.port(k)
            # Both ends are made inside namespaces: the root namespace never sees either.
            _ip("-n", hub, "link", "add", port, "type", "veth", "peer", "name", NODE_IF, "netns", name)
            _ip("-n", hub, "link", "set", port, "addrgenmode", "none")
            _ip("-n", hub, "link", "set", port, "master", BRIDGE)
            _ip("-n", name, "link", "set", NODE_IF, "addrgenmode", "none")  # no IPv6 link-local traffic
            _ip("-n", name, "addr", "add", f"{self.address(k)}/24", "dev", NODE_IF)
            self._shape(name, NODE_IF)  # what node k sends
            self._shape(hub, port)  # what node k receives
            _ip("-n", hub, "link", "set", port, "up")
            _ip("-n", name, "link", "set", NODE_IF, "up")
        self.counters()  # readable, or fail now

    # ---- use ----------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.size

    def address(self, k: int) -> str:
        """Node ``k``'s address (``10.x.y.(k+1)``)."""
        if not 0 <= k < self.size:
            raise IndexError(f"no node {k} (nodes 0..{self.size - 1})")
        return f"{self._net}.{k + 1}"

    def addresses(self) -> list[str]:
        return [self.address(k) for k in range(self.size)]

    def namespace(self, k: int) -> str:
        self.address(k)  # range check
        return self.names[k]

    @staticmethod
    def port(k: int) -> str:
        """The hub-side end of node ``k``'s link."""
        return f"v{k}"

    def wrap(self, k: int, argv: list[str]) -> list[str]:
        """``argv`` run in node ``k`` (``ip netns exec`` execs it: same PID), with the
        topology's join token: a server bound beyond loopback refuses to start without one."""
        return ["ip", "netns", "exec", self.namespace(k), "env", f"{JOIN_TOKEN_ENV}={self.join_token}", *argv]

    def counters(self) -> dict[int, Link]:
        """Every node's bytes so far, from its own side (sent: ``tx``, received: ``rx``)."""
        if self.hub is None or self.hub.anchor is None or self.hub.anchor.poll() is not None:
            raise OSError(f"the anchor process of {self.hub_name} is gone")
        ports = _parse_all(Path(f"/proc/{self.hub.anchor.pid}/net/dev").read_text())
        out = {}
        for k in range(self.size):
            try:
                port_rx, port_tx = ports[self.port(k)]
            except KeyError:
                raise OSError(f"no port {self.port(k)} in {self.hub_name}") from None
            out[k] = Link(rx=port_tx, tx=port_rx)
        return out

    def bytes_of(self, nodes: list[int]) -> int:
        """Sent plus received bytes over the links of ``nodes`` so far."""
        c = self.counters()
        return sum(c[k].total for k in nodes)

    def resources(self) -> list[str]:
        """Namespace names this topology created and still holds."""
        return list(self._made)

    def close(self) -> None:
        """Delete every link and namespace this topology made (safe to call twice)."""
        errors = []
        if self.hub is not None:
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                _delete_namespace_links(self.hub_name)  # every veth pair and the bridge
            try:
                self.hub.close()  # the anchor and the hub namespace
            except (OSError, subprocess.TimeoutExpired) as e:
                errors.append(str(e))
            self.hub = None
        for name in reversed(self._made):
            try:
                _delete_namespace(name)
            except (OSError, subprocess.TimeoutExpired) as e:
                errors.append(str(e))
        left = [n for n in self._made if netns.exists(n)]
        self._made = left
        if left:
            raise OSError(f"could not delete network namespaces {', '.join(left)}: {'; '.join(errors)}")

    def __enter__(self) -> Topology:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- measuring a link ------------------------------------------------------------------------

_RECEIVER = r"""
import json, socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((host, port)); srv.listen(1); srv.settimeout(seconds + 30)
print("listening", flush=True)
conn, _ = srv.accept(); conn.settimeout(10)
got, marks, buf = 0, [], bytearray(1 << 20)
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    got += n
    now = time.monotonic()
    if not marks or now - marks[-1][0] >= 0.02:
        marks.append((now, got))
marks.append((time.monotonic(), got))
print(json.dumps({"bytes": got, "marks": marks}), flush=True)
"""

_SENDER = r"""
import socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + 20
while True:
    try:
        s = socket.create_connection((host, port), timeout=5); break
    except OSError:
        if time.monotonic() > deadline: raise
        time.sleep(0.05)
chunk, end = b"\0" * (1 << 16), time.monotonic() + seconds
while time.monotonic() < end:
    s.sendall(chunk)
s.close()
"""


def rate_from_marks(marks: list[tuple[float, int]], skip_s: float = 0.5) -> float:
    """Mbit/s (payload) of a receiver's (time, bytes so far) marks, after its first ``skip_s``
    seconds (TCP's slow start): the median of the rates over windows of 0.25 s."""
    if len(marks) < 3:
        raise ValueError("too few marks to time a transfer")
    t0 = marks[0][0] + skip_s
    inside = [(t, b) for t, b in marks if t >= t0]
    if len(inside) < 3 or inside[-1][0] - inside[0][0] <= 0:
        raise ValueError("the transfer was too short to time")
    rates, start = [], inside[0]
    for t, b in inside[1:]:
        if t - start[0] >= 0.25:
            rates.append(8 * (b - start[1]) / (t - start[0]) / 1e6)
            start = (t, b)
    if not rates:
        t1, b1 = inside[-1]
        return 8 * (b1 - inside[0][1]) / (t1 - inside[0][0]) / 1e6
    return statistics.median(rates)


def measure_tcp(topo: Topology, src: int, dst: int, seconds: float = 3.0, port: int = 5201) -> dict:
    """One TCP stream from node ``src`` to node ``dst`` for ``seconds``: payload Mbit/s
    (``rate_mbit``, see ``rate_from_marks``) and the bytes both links counted."""
    recv = subprocess.Popen(topo.wrap(dst, [sys.executable, "-c", _RECEIVER, topo.address(dst), str(port),
                                            str(seconds)]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    send = None
    try:
        line = recv.stdout.readline()
        if "listening" not in line:
            raise OSError(f"the receiver in node {dst} did not start: {line}{recv.stderr.read()[-2000:]}")
        before = topo.counters()
        send = subprocess.Popen(topo.wrap(src, [sys.executable, "-c", _SENDER, topo.address(dst), str(port),
                                                str(seconds)]),
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True,
                                start_new_session=True)
        _, serr = send.communicate(timeout=seconds + 30)
        out, rerr = recv.communicate(timeout=30)
        after = topo.counters()
        if send.returncode != 0 or recv.returncode != 0:
            raise OSError(f"transfer {src} -> {dst} failed: {serr[-2000:]} {rerr[-2000:]}")
        result = json.loads(out.strip().splitlines()[-1])
    finally:
        for p in (send, recv):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
    return {"rate_mbit": rate_from_marks(result["marks"]), "payload_bytes": result["bytes"],
            "sent_by_src": after[src].tx - before[src].tx, "received_by_dst": after[dst].rx - before[dst].rx}


def ping(topo: Topology, src: int, dst: int, timeout: float = 10.0) -> bool:
    """Whether node ``src`` reaches node ``dst`` over TCP (a connection to a port nobody listens
    on is refused by ``dst``: an answer, so the path works; no ICMP tool needed)."""
    code = ("import socket,sys\n"
            "try:\n socket.create_connection((sys.argv[1], 9), timeout=3).close()\n"
            "except ConnectionRefusedError:\n pass\n")
    r = subprocess.run(topo.wrap(src, [sys.executable, "-c", code, topo.address(dst)]), capture_output=True,
                       text=True, timeout=timeout, check=False)
    return r.returncode == 0


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks multihost [--nodes N] [--rate MBIT]``: build, measure node 0 -> 1, remove."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks multihost", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rate", type=float, default=50.0, help="Mbit/s of every link, each way (default 50)")
    p.add_argument("--qdisc", choices=QDISCS, default="tbf")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--cleanup", action="store_true", help="only delete what dead harnesses left behind")
    args = p.parse_args(argv)
    if args.cleanup:
        print("removed:", " ".join(cleanup_stale()) or "nothing")
        return 0
    reason = available()
    if reason:
        print(f"cannot build a topology here: {reason}", file=sys.stderr)
        return 2
    cleanup_stale()
    with Topology(max(2, args.nodes), args.rate, qdisc=args.qdisc) as topo:
        print(f"{len(topo)} nodes on {topo.subnet}: {' '.join(topo.addresses())}, {args.rate:g} Mbit/s each way "
              f"({args.qdisc})")
        r = measure_tcp(topo, 0, 1, args.seconds)
        print(f"node 0 -> node 1: {r['rate_mbit']:.1f} Mbit/s payload ({r['sent_by_src'] / 1e6:.1f} MB on node 0's "
              f"link, {r['received_by_dst'] / 1e6:.1f} MB on node 1's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
