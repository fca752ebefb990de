"""Free TCP ports for the processes a launcher starts (the demo, the benchmarks, the tests).

A port from ``bind(("", 0))`` is one of the kernel's ephemeral ports: the same range it hands
to every outgoing connection, so between the pick and the child's ``bind`` any ``connect`` on the
host (an RPC agent, a gRPC channel) may take it, and the child dies with "Address already in
use". Ports below (or above) that range are given only to those who bind them by number.
"""

from __future__ import annotations

import logging
import random
import socket
from pathlib import Path

log = logging.getLogger(__name__)

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LINUX_DEFAULT = (32768, 60999)
LOWEST = 10000
"""Below this sit well-known services (databases, X, registries): never handed out."""

_handed_out: set[int] = set()
_rng = random.Random()


def ephemeral_range(path: Path = EPHEMERAL_RANGE) -> tuple[int, int]:
    """The kernel's range for outgoing connections (Linux's default where it cannot be read)."""
    try:
        low, high = (int(word) for word in path.read_text().split())
    except (OSError, ValueError):
        return LINUX_DEFAULT
    return low, high


def fixed_ports(path: Path = EPHEMERAL_RANGE) -> range:
    """Ports the kernel never gives an outgoing connection: the larger span on either side of its
    ephemeral range (from ``LOWEST``), or the span above the range if both are small."""
    low, high = ephemeral_range(path)
    below, above = range(LOWEST, max(LOWEST, low)), range(high + 1, 65536)
    return below if len(below) >= len(above) else above


def free_port(host: str = "127.0.0.1", ports: range | None = None) -> int:
    """A port of ``ports`` (default ``fixed_ports()``) nobody has bound on ``host``, never one this
    process handed out before; the kernel's pick (ephemeral) only if every try is taken."""
    ports = ports if ports is not None and len(ports) else fixed_ports()
    for _ in range(min(256, len(ports))):
        port = _rng.choice(ports)
        if port not in _handed_out and _bindable(host, port):
            _handed_out.add(port)
            return port
    log.warning("no free port among %d to %d, taking an ephemeral one", ports.start, ports.stop - 1)
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port


def _bindable(host: str, port: int) -> bool:
    # No SO_REUSEADDR: a port with a connection in TIME_WAIT counts as taken too.
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
