"""The RPC surface between server processes (``--num-servers``): one function, thin.

Server 0 calls ops of the partition servers (a trainer joined or left, write or load a
partition of a checkpoint, status, stop); a partition server calls ops of server 0 (register,
stopping). Each process installs the one object that answers its ops; the work is there
(``psserver.server.group.server_group`` on server 0, ``psserver.server.group.partition_server`` on the others),
none here.
"""

from __future__ import annotations

from typing import Any, Protocol


class PeerRole(Protocol):
    peer_ops: tuple[str, ...]
    """The ops another server process may call."""


_role: PeerRole | None = None


def install(role: PeerRole | None) -> None:
    global _role
    _role = role


def server_call(op: str, args: tuple) -> Any:
    """Runs ``op(*args)`` of this process's role, if it is one of its ``peer_ops``."""
    role = _role
    if role is None:
        raise RuntimeError("this process is not part of a parameter server of several processes")
    if op not in role.peer_ops:
        raise ValueError(f"no server op {op!r}")
    return getattr(role, op)(*args)
