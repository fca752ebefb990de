"""RPC set-up: the rendezvous store, the transport, and the worker names.

Traps of ``torch.distributed.rpc`` handled here:
- the rank-0 TCPStore binds every interface; we bind the socket ourselves to ``--host`` and
  hand its file descriptor to the store;
- TensorPipe's ``shm`` transport busy-polls a core per process; we use ``uv`` only and point
  it at the interface that owns the server's address (``TP_SOCKET_IFNAME``);
- RPC worker names may not contain ``-`` or ``.`` in dynamic groups (the agent parses
  ``name-id,`` lists), so an incarnation is ``trainer_<rank>_<incarnation>``;
- joining a dynamic group calls every member, so a dead one fails the join (holding the
  group's membership token): a trainer asks the server to make room first
  (:func:`request_admission`), through the store, before it joins.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import os
import socket
import tempfile
import threading
import time
from collections.abc import Iterator

import psutil
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.rendezvous import register_rendezvous_handler

from psserver.errors import ServerUnavailable, UsageError

log = logging.getLogger(__name__)

SCHEME = "psserver"
SERVER_NAME = "psserver"
# Keys the server keeps in the store, outside RPC's own prefix.
KEY_INCARNATION = "psserver/incarnation/{rank}"
KEY_SERVER_STATE = "psserver/state"
KEY_NEXT_RPC_ID = "psserver/next_rpc_id"
KEY_ADMIT_SEQ = "psserver/admit/seq"
"""Counter of the joins announced to the server (:func:`request_admission`)."""
KEY_ADMIT_REQUEST = "psserver/admit/request/{seq}"
"""The rank a join announced as ``seq`` asks for."""
KEY_ADMIT_ANSWER = "psserver/admit/answer/{seq}"
"""The server's answer: ``ADMITTED``, or why not (one line for the user)."""
ADMITTED = "ok"
ADMISSION_TIMEOUT_S = 15.0
"""How long a joining trainer waits for the server's answer: it pings the members (two seconds
at most) and evicts the dead ones."""
MAX_RPC_ID = 2**15 - 1
"""RPC worker ids are 16-bit signed integers (``worker_id_t``); 0 is the server."""

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
    if rpc_id > MAX_RPC_ID:
        raise UsageError(f"this server has seen {MAX_RPC_ID} joins: restart it (with --resume) to reset RPC ids")
    return rpc_id


def request_admission(store, rank: int, where: str, timeout: float = ADMISSION_TIMEOUT_S) -> None:
    """Ask the server to make room for a join of ``rank``, before this process joins the RPC group.

    ``init_rpc`` calls every member of the group, so a member that died (the rank's last
    holder, crashed and restarted at once by Kubernetes or Slurm) would fail the join while it
    holds the group's token. The server pings its members, evicts the dead ones and the rank's
    holder if it does not answer (``Membership.admit``), then answers here. ``UsageError`` when
    the rank's holder is alive; ``ServerUnavailable`` when the server does not answer.
    """
    seq = int(store.add(KEY_ADMIT_SEQ, 1))
    store.set(KEY_ADMIT_REQUEST.format(seq=seq), str(rank))
    answer_key = KEY_ADMIT_ANSWER.format(seq=seq)
    try:
        store.wait([answer_key], datetime.timedelta(seconds=timeout))
        answer = store.get(answer_key).decode()
    except RuntimeError:  # DistStoreError: no answer in time, or the store went away
        raise ServerUnavailable(f"the psserver at {where} did not answer the join of rank {rank} within "
                                f"{timeout:g}s") from None
    with contextlib.suppress(RuntimeError):
        store.delete_key(answer_key)
    if answer != ADMITTED:
        raise UsageError(answer)


def ping() -> bool:
    """Runs on a trainer when the server asks whether it is alive (``Membership.admit``)."""
    return True


def interface_for(host: str) -> str | None:
    """Name of the local interface that owns ``host``'s address (for ``TP_SOCKET_IFNAME``)."""
    try:
        addr = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if addr.is_loopback:
        return "lo"
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET and a.address == str(addr):
                return name
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
    """A client of the server's store; waits up to ``connect_timeout`` for a server that is starting.

    ``UsageError`` at once for a port that answers but is not a psserver's (the control
    plane's, most likely): waiting would not change it.
    """
    deadline = time.monotonic() + connect_timeout
    delay = 0.2
    last: Exception | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            _probe(host, port, timeout=min(remaining, 5.0))
            store = _store_client(host, port, max(1.0, min(remaining, 30.0)))
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
            if "Ping failed" in str(e):  # something answered, not with the store's protocol
                raise UsageError(f"{host}:{port} is not a psserver RPC port (it does not speak the rendezvous "
                                 "protocol): point --server at the --port of psserver serve") from None
            last = e
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 2.0)
    reason = getattr(last, "strerror", None) or str(last).splitlines()[0] if last else "timed out"
    raise ServerUnavailable(f"cannot reach a psserver at {host}:{port} within {connect_timeout:g}s ({reason})")


_HTTP2_SETTINGS = 0x04


def _probe(host: str, port: int, timeout: float) -> None:
    """Connect once; a server that speaks first is not a rendezvous store (which only answers).

    gRPC, psserver's control plane included, opens with an HTTP/2 SETTINGS frame.
    """
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.settimeout(0.2)
        try:
            first = sock.recv(16)
        except (TimeoutError, ConnectionResetError):
            return
    if not first:
        return  # closed at once: a store busy starting up, or nothing; TCPStore will say
    what = "a gRPC (HTTP/2) server, psserver's control plane?" if len(first) >= 4 and first[3] == _HTTP2_SETTINGS \
        else "a server that speaks first"
    raise UsageError(f"{host}:{port} is not a psserver RPC port ({what}): point --server at the --port of "
                     "psserver serve")


_ANSWER_S = 5.0
"""A listening store answers the client's handshake in milliseconds; a port that accepts the
connection and stays silent this long is something else."""


def _store_client(host: str, port: int, timeout: float) -> dist.TCPStore:
    """``TCPStore`` as a client, bounded: its handshake never times out against a server that
    accepts the connection and waits for more (any HTTP server, say)."""
    box: list = []

    def connect() -> None:
        try:
            box.append(dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout), use_libuv=True))
        except (RuntimeError, OSError) as e:
            box.append(e)

    worker = threading.Thread(target=connect, name="psserver-store-connect", daemon=True)
    with _quiet_stderr():  # TCPStore logs every failed try with a C++ backtrace
        worker.start()
        worker.join(min(timeout, _ANSWER_S))
    if not box:
        raise UsageError(f"{host}:{port} is not a psserver RPC port (it accepted the connection but never answered "
                         "the rendezvous handshake): point --server at the --port of psserver serve")
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Send what C++ code writes to file descriptor 2 to the debug log instead."""
    try:
        saved = os.dup(2)
    except OSError:  # no descriptor 2 to protect
        yield
        return
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            text = sink.read().decode(errors="replace").strip()
            if text:
                log.debug("TCPStore: %s", text)


def forget_store(url: str) -> None:
    _stores.pop(url, None)
