"""A version of the weights as it crossed: what the network and the host's shared copy carry."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Raw:
    """A version as it crossed: its header's facts and all its bytes, checked against its CRC-32."""

    step: int
    published_at: float
    model: str
    crc32: int
    metas: list[tuple[str, str, tuple[int, ...], int]]
    """Each tensor's key, dtype name, shape and bytes, in the order of ``data``."""
    data: bytearray | memoryview
    """Writable: the version's tensors are views of it (a private mapping of the host's copy)."""
    clock: float
    """The server's clock minus the receiver's, when the header came."""
