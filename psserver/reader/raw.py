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
    path: str | None = None
    """The server's own file of the version (a server on this host): a host copy links it in."""
    history: str = ""
    """The server's line of versions (``VersionHeader.history``): steps only grow within one."""

    @classmethod
    def of_file(cls, header: dict, data: memoryview, path: str | None = None) -> Raw:
        """A version file's (``psserver.common.version_files``); ``path``: the server's own file."""
        metas = [(k, d, tuple(shape), int(n)) for k, d, shape, n in header["metas"]]
        return cls(int(header["step"]), float(header["published_at"]), header["model"], int(header["crc32"]),
                   metas, data, float(header["clock"]), path, str(header.get("history", "")))
