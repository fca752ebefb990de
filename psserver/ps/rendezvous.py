"""RPC set-up: the rendezvous store, the transport, and the worker names.

Three traps of ``torch.distributed.rpc`` are handled here (see DESIGN.md):
- the rank-0 TCPStore binds every interface; we bind the socket ourselves to ``--host`` and
  hand its file descriptor to the store;
- TensorPipe's ``shm`` transport busy-polls a core per process; we use ``uv`` only and point
  it at the interface that owns the server's address (``TP_SOCKET_IFNAME``);
- RPC worker names may not contain ``-`` or ``.`` in dynamic groups (the agent parses
  ``name-id,`` lists), so an incarnation is ``trainer_<rank>_<incarnation>``.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import time
from typing import Iterator

import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.rendezvous import register_rendezvous_handler

from psserver.errors import ServerUnavailable, UsageError

log = logging.getLogger(__name__)

SCHEME = "psserver"
SERVER_NAME = "psserver"
# Keys the server keeps in the store, outside RPC's own prefix.
KEY_LIVE = "psserver/live/{rank}"
KEY_INCARNATION = "psserver/incarnation/{rank}"
KEY_SERVER_STATE = "psserver/state"
KEY_NEXT_RPC_ID = "psserver/next_rpc_id"

_stores: dict[str, dist.Store] = {}


def _handler(url: str, **kwargs) -> Iterator[tuple[dist.Store, int, int | None]]:
    store = _stores.get(url.split("?", 1)[0])
    if store is None:
        raise ValueError(f"no store registered for {url}")
    yield store, 0, None


register_rendezvous_handler(SCHEME, _handler)


def trainer_name(rank: int, incarnation: int) -> str:
    return f"trainer_{rank}_{incarnation}"


def next_rpc_id(store) -> int:
    """A fresh RPC worker id for every join (the server is 0).

    Reusing ids (say rank + 1) is unsafe in a group whose members die: the agent, the store
    and distributed autograd (context ids carry the worker id in their top 16 bits) all key
    state by id, so a new incarnation would meet what the old one left behind.
    """
    rpc_id = int(store.add(KEY_NEXT_RPC_ID, 1))
    if rpc_id >= 2**16:
        raise UsageError("this server has seen 65535 joins: restart it (with --resume) to reset RPC ids")
    return rpc_id


def interface_for(host: str) -> str | None:
    """Name of the local interface that owns ``host``'s address (for ``TP_SOCKET_IFNAME``)."""
    try:
        addr = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if addr.is_loopback:
        return "lo"
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            for a in addrs:
                if a.family == socket.AF_INET and a.address == str(addr):
                    return name
    except ImportError:  # pragma: no cover - psutil is a dependency
        pass
    return None


def route_interface(remote_host: str) -> str | None:
    """The local interface a trainer uses to reach ``remote_host`` (so the server can call back)."""
    try:
        addr = ipaddress.ip_address(socket.gethostbyname(remote_host))
    except (OSError, ValueError):
        return None
    if addr.is_loopback:
        return "lo"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((str(addr), 9))
            local = s.getsockname()[0]
    except OSError:
        return None
    return interface_for(local)


def set_transport_interface(host: str, *, local: bool) -> None:
    """Point TensorPipe's uv transport at the right interface unless the user chose one."""
    if os.environ.get("TP_SOCKET_IFNAME"):
        return
    ifname = interface_for(host) if local else route_interface(host)
    if ifname:
        os.environ["TP_SOCKET_IFNAME"] = ifname
        log.debug("TP_SOCKET_IFNAME=%s", ifname)


def backend_options(url: str, rpc_timeout: float, num_threads: int) -> rpc.TensorPipeRpcBackendOptions:
    return rpc.TensorPipeRpcBackendOptions(
        init_method=url,
        rpc_timeout=rpc_timeout,
        num_worker_threads=num_threads,
        _transports=["uv"],
    )


def create_server_store(host: str, port: int, timeout: float) -> tuple[dist.TCPStore, str]:
    """The master store, listening on ``host:port`` only. ``UsageError`` if the port is taken."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise UsageError(f"cannot resolve --host {host}: {e}") from None
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(512)
    store = dist.TCPStore(
        host,
        port,
        None,
        True,
        datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
        master_listen_fd=sock.detach(),
        use_libuv=True,
    )
    url = f"{SCHEME}://{host}:{port}/server"
    _stores[url] = store
    return store, url


def connect_store(host: str, port: int, connect_timeout: float, op_timeout: float) -> tuple[dist.TCPStore, str]:
    """A client of the server's store; waits up to ``connect_timeout`` for a server that is starting."""
    deadline = time.monotonic() + connect_timeout
    delay = 0.2
    last: Exception | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=min(remaining, 5.0)):
                pass
            store = dist.TCPStore(
                host, port, None, False, datetime.timedelta(seconds=max(1.0, min(remaining, 30.0))), use_libuv=True
            )
            store.set_timeout(datetime.timedelta(seconds=op_timeout))
            # A store that answers but whose server has not finished starting: wait for it.
            while not store.check([KEY_SERVER_STATE]) or store.get(KEY_SERVER_STATE) == b"STARTING":
                if time.monotonic() > deadline:
                    raise ServerUnavailable(f"server at {host}:{port} did not finish starting in {connect_timeout:g}s")
                time.sleep(0.2)
            url = f"{SCHEME}://{host}:{port}/client"
            _stores[url] = store
            return store, url
        except ServerUnavailable:
            raise
        except (OSError, RuntimeError) as e:
            last = e
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 2.0)
    reason = getattr(last, "strerror", None) or str(last).splitlines()[0] if last else "timed out"
    raise ServerUnavailable(f"cannot reach a psserver at {host}:{port} within {connect_timeout:g}s ({reason})")


def forget_store(url: str) -> None:
    _stores.pop(url, None)
