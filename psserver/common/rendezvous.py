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
  (:func:`request_admission`), through the store, before it joins;
- the TCPStore lets anyone who connects read and write any key, torch RPC's own keys
  included. With a join token, every key of the job lives under a prefix derived from the
  token (:func:`namespace`): a peer without it finds neither the server's keys nor the RPC
  group, and its ``init_rpc`` makes a group of its own. Only ``KEY_HELLO`` is public.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import re
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import psutil
import torch.distributed as dist
import torch.distributed.rpc as rpc
from torch.distributed.rendezvous import register_rendezvous_handler

from psserver.common.messages import plain_data
from psserver.errors import AdmissionUnanswered, ServerUnavailable, UsageError, first_line

log = logging.getLogger(__name__)

SCHEME = "psserver"
SERVER_NAME = "psserver"
# Keys the server keeps in the store, outside RPC's own prefix (inside the job's namespace).
KEY_SERVER_STATE = "psserver/state"
STARTING, SERVING, DRAINING = "STARTING", "SERVING", "DRAINING"
WAITING = "WAITING"
"""Several server processes: one is missing (not registered yet, or lost); no steps meanwhile."""
KEY_MODEL = "psserver/model"
"""JSON: the server's model as a trainer needs it before joining: ``model`` (its reference,
None while a server started without ``--model`` has learnt none), ``model_args``, ``seed``,
``embedding_dim`` and ``fingerprint`` (None: no model yet, the first trainer sends its initial
values)."""
KEY_HELLO = "psserver/hello"
"""Public, outside any namespace: ``token`` or ``open``, so that a trainer without the right
token is told so at once instead of waiting for a state it cannot see. Trusted for nothing
else (anyone can write it; the server puts it back)."""
HELLO_TOKEN, HELLO_OPEN = "token", "open"
WRONG_TOKEN_GRACE_S = 2.0
"""How long a trainer looks for the job's keys while the hello disagrees with its token (the
server writes its state before its hello, and puts back a hello that someone changed, so only
a real mismatch lasts this long)."""
KEY_ADMIT_SEQ = "psserver/admit/seq"
"""Counter of the joins announced to the server (:func:`request_admission`)."""
KEY_ADMIT_REQUEST = "psserver/admit/request/{seq}"
"""The rank a join announced as ``seq`` asks for."""
KEY_ADMIT_ANSWER = "psserver/admit/answer/{seq}"
"""The server's answer: ``ADMITTED <rpc id> <incarnation>``, or why not (one line for the user)."""
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


def is_trainer_name(name: str) -> bool:
    """Whether ``name`` is a trainer's RPC name (one incarnation's, never used again)."""
    return re.fullmatch(r"trainer_\d+_\d+", name) is not None


def server_name(server_rank: int) -> str:
    """The RPC name of server process ``server_rank`` (server 0 keeps the one-server name; no
    ``-`` in it: torch's dynamic group reads its member list as ``name-id`` up to the first one)."""
    return SERVER_NAME if server_rank == 0 else f"{SERVER_NAME}_{server_rank}"


SERVER_REQUEST_PREFIX = "s"
"""An admission request ``s<rank>`` is a server process's, not a trainer's."""


def join_token(config) -> str | None:
    """The join token of a ``ServerConfig`` or ``TrainerConfig``, read once at start; an empty
    or unreadable file is the user's mistake (``UsageError``)."""
    try:
        return config.join_token()
    except ValueError as e:
        raise UsageError(str(e)) from None


def namespace(token: str | None) -> str:
    """The job's key prefix in the store: derived from the join token, so only those who know
    it can read or write the job's keys; "" (no prefix) without a token."""
    if token is None:
        return ""
    return "job-" + hmac.new(token.encode(), b"psserver store namespace v1", hashlib.sha256).hexdigest()[:32]


def scoped(store, token: str | None):
    """``store`` seen through the job's namespace."""
    prefix = namespace(token)
    return dist.PrefixStore(prefix, store) if prefix else store


def request_admission(store, rank: int, where: str, timeout: float = ADMISSION_TIMEOUT_S, *,
                      server: bool = False) -> tuple[int, int]:
    """Ask the server to make room for a join of ``rank``, before this process joins the RPC group.

    ``init_rpc`` calls every member of the group, so a member that died (the rank's last
    holder, crashed and restarted at once by Kubernetes or Slurm) would fail the join while it
    holds the group's token. The server pings its members, evicts the dead ones and the rank's
    holder if it does not answer (``Membership.admit``), then answers here with the RPC id and
    the incarnation to join with. ``UsageError`` when the rank's holder is alive;
    ``ServerUnavailable`` when the server does not answer. ``server``: a server process of
    ``rank`` asks (several server processes).
    """
    try:
        seq = int(store.add(KEY_ADMIT_SEQ, 1))
        store.set(KEY_ADMIT_REQUEST.format(seq=seq), (SERVER_REQUEST_PREFIX if server else "") + str(rank))
    except RuntimeError as e:  # DistNetworkError and the like: the server died since its store answered
        raise AdmissionUnanswered(f"the psserver at {where} went away before it admitted rank {rank} "
                                  f"({first_line(e, 160)})") from None
    answer_key = KEY_ADMIT_ANSWER.format(seq=seq)
    try:
        store.wait([answer_key], datetime.timedelta(seconds=timeout))
        answer = store.get(answer_key).decode()
    except RuntimeError as e:  # DistStoreError: no answer in time, or the store went away
        if "timeout" in str(e).lower():
            raise AdmissionUnanswered(f"the psserver at {where} did not answer the join of rank {rank} within "
                                      f"{timeout:g}s") from None
        raise AdmissionUnanswered(f"the psserver at {where} went away while it admitted rank {rank} "
                                  f"({first_line(e, 160)})") from None
    with contextlib.suppress(RuntimeError):
        store.delete_key(answer_key)
    word, *ids = answer.split()
    if word != ADMITTED:
        raise UsageError(answer)
    try:
        rpc_id, incarnation = (int(i) for i in ids)
    except ValueError:
        raise ServerUnavailable(f"the psserver at {where} answered the join of rank {rank} with {answer[:80]!r}") \
            from None
    return rpc_id, incarnation


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


TP_CHANNELS = ("basic", "cma", "mpt_uv", "cuda_basic", "cuda_ipc", "cuda_gdr", "cuda_xth")
"""TensorPipe's channels, of which ``PSSERVER_TP_CHANNELS`` may keep some: ``cuda_basic,basic``
makes CUDA tensors cross as between hosts without GPUDirect (staged in host memory inside
TensorPipe), on one host, for measuring that path."""


def tp_channels() -> list[str] | None:
    """The channels ``PSSERVER_TP_CHANNELS`` keeps (None: TensorPipe's own choice)."""
    value = os.environ.get("PSSERVER_TP_CHANNELS", "").strip()
    if not value:
        return None
    channels = [c.strip() for c in value.split(",") if c.strip()]
    unknown = [c for c in channels if c not in TP_CHANNELS]
    if unknown or not channels:
        raise UsageError(f"PSSERVER_TP_CHANNELS={value!r}: each must be one of {', '.join(TP_CHANNELS)}")
    return channels


def backend_options(url: str, rpc_timeout: float, num_threads: int, *, device_maps: dict | None = None,
                    devices: list | None = None) -> rpc.TensorPipeRpcBackendOptions:
    """The agent's options: the ``uv`` transport (the ``shm`` one busy-polls a core per process),
    and for CUDA tensors crossing as they are, ``device_maps`` (a trainer's, to the server) and
    ``devices`` (a server's CUDA devices, which trainers' maps point at)."""
    return rpc.TensorPipeRpcBackendOptions(
        init_method=url,
        rpc_timeout=rpc_timeout,
        num_worker_threads=num_threads,
        _transports=["uv"],
        _channels=tp_channels(),
        device_maps=device_maps,
        devices=devices,
    )


def create_server_store(host: str, port: int, timeout: float, token: str | None) -> tuple[dist.TCPStore, object, str]:
    """The master store, listening on ``host:port`` only, and the job's view of it (through
    the token's namespace, which RPC uses too). ``UsageError`` if the port is taken."""
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
    job = _stores[url] = scoped(store, token)
    return store, job, url


def connect_store(host: str, port: int, connect_timeout: float, op_timeout: float,
                  token: str | None = None, *, until_serving: bool = True) -> tuple[object, str]:
    """The job's view of the server's store (through the token's namespace); waits up to
    ``connect_timeout`` for a server that is starting.

    ``UsageError`` for a port that answers but is not a psserver's (the control plane's, most
    likely: at once; a port that accepts and stays silent: after ``_SILENT_S``), and for a
    token the server does not share: waiting would not change either. ``until_serving=False``
    (a server process joining server 0): return once the server's state is there, whatever it is.
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
            job = scoped(store, token)
            _wait_until_serving(store, job, token, f"{host}:{port}", deadline, connect_timeout,
                                (SERVING, DRAINING) if until_serving else None)
            url = f"{SCHEME}://{host}:{port}/client"
            _stores[url] = job
            return job, url
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


def model_info(store) -> dict:
    """What the server published under ``KEY_MODEL`` (``UsageError`` for a server that did not:
    a psserver older than this trainer)."""
    if not store.check([KEY_MODEL]):
        raise UsageError("the server publishes no model (a psserver older than this trainer?)")
    raw = store.get(KEY_MODEL)
    if len(raw) > MAX_PUBLISHED_BYTES:
        raise UsageError(f"the server's published model is over {MAX_PUBLISHED_BYTES} bytes: not what a psserver "
                         "publishes")
    try:
        info = json.loads(raw)
    except (ValueError, RecursionError):
        raise UsageError("the server's published model is not readable JSON") from None
    if not isinstance(info, dict):
        raise UsageError("the server's published model is not a JSON object")
    why = plain_data(info.get("model_args"))
    if why is not None:
        raise UsageError(f"the server's published model has model_args that {why}: not what a psserver publishes")
    for key, kinds, check in _PUBLISHED:
        value = info.get(key)
        if value is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)
                                  or not check(value)):
            raise UsageError(f"the server's published model has a malformed {key!r} "
                             f"({json.dumps(value)[:60]}): not what a psserver publishes")
    return info


MAX_PUBLISHED_BYTES = 1 << 20

_PUBLISHED: tuple[tuple[str, tuple[type, ...], Any], ...] = (
    ("model", (str,), lambda v: 0 < len(v) <= 1024),
    ("model_args", (dict,), lambda v: True),
    ("pinned", (bool,), lambda v: True),
    ("seed", (int,), lambda v: 0 <= v < 2**63),
    ("embedding_dim", (int,), lambda v: 0 < v <= 2**20),
    ("fingerprint", (str,), lambda v: len(v) <= 1024),
    ("devices", (list,), lambda v: all(isinstance(d, str) for d in v)),
    ("num_servers", (int,), lambda v: 0 < v <= 2**16),
    ("host_id", (str,), lambda v: len(v) <= 1024),
)
"""What a server publishes under ``KEY_MODEL``, each field's type and bounds: whoever may write
the store (anyone reaching it without a join token) can put anything there, and a value no
server writes is one line for the trainer, never an error deep in building its model."""


def _wait_until_serving(store, job, token: str | None, where: str, deadline: float, connect_timeout: float,
                        states: tuple[str, ...] | None) -> None:
    """Wait for the server's state to be one of ``states`` (None: any), read inside the job's
    namespace (which no one without the token can write); the public hello only decides how
    soon a token mismatch is reported."""
    mismatch_since: float | None = None
    state = b""
    while True:
        if job.check([KEY_SERVER_STATE]):
            state = job.get(KEY_SERVER_STATE)
            if states is None or state.decode(errors="replace") in states:
                return
        hello = store.get(KEY_HELLO)[:16] if store.check([KEY_HELLO]) else b""
        now = time.monotonic()
        needs_token = hello == HELLO_TOKEN.encode()
        if (needs_token and token is None) or (token is not None and hello == HELLO_OPEN.encode()) or \
                (needs_token and token is not None):
            mismatch_since = now if mismatch_since is None else mismatch_since
            if now - mismatch_since >= WRONG_TOKEN_GRACE_S:
                if token is None:
                    raise UsageError(f"the psserver at {where} needs a join token: pass --join-token-file or set "
                                     "PSSERVER_JOIN_TOKEN")
                if not needs_token:
                    raise UsageError(f"the psserver at {where} takes no join token, but this trainer has one: "
                                     "start the server with the same --join-token-file, or drop it here")
                raise UsageError(f"the psserver at {where} did not accept this join token (wrong "
                                 "--join-token-file or PSSERVER_JOIN_TOKEN?)")
        else:
            mismatch_since = None
        if now > deadline:
            if state == WAITING.encode():
                raise ServerUnavailable(f"the psserver at {where} waits for a missing server process (see its log or "
                                        f"psserver status); gave up after {connect_timeout:g}s")
            raise ServerUnavailable(f"server at {where} did not finish starting in {connect_timeout:g}s")
        time.sleep(0.2)


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


_SILENT_S = 2 * _ANSWER_S
"""How long a handshake may stay unanswered before the port is declared not a psserver's: a
store on a loaded machine (a server just restarted beside its trainers, on two cores) once
took longer than ``_ANSWER_S``."""


def _store_client(host: str, port: int, timeout: float) -> dist.TCPStore:
    """``TCPStore`` as a client, bounded: its handshake never times out against a server that
    accepts the connection and waits for more (any HTTP server, say). ``UsageError`` when it
    stays unanswered ``_SILENT_S``; ``TimeoutError`` when ``timeout`` ends first."""
    box: list = []

    def connect() -> None:
        try:
            box.append(dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout), use_libuv=True))
        except (RuntimeError, OSError) as e:
            box.append(e)

    worker = threading.Thread(target=connect, name="psserver-store-connect", daemon=True)
    wait = min(timeout, _SILENT_S)
    with _quiet_stderr():  # TCPStore logs every failed try with a C++ backtrace
        worker.start()
        worker.join(min(wait, _ANSWER_S))
    if not box and wait > _ANSWER_S:
        log.warning("%s:%d accepted the connection but has not answered the rendezvous handshake in %gs; "
                    "waiting up to %gs more", host, port, _ANSWER_S, wait - _ANSWER_S)
        with _quiet_stderr():
            worker.join(wait - _ANSWER_S)
    if not box and wait < _SILENT_S:
        raise TimeoutError(f"the rendezvous handshake was not answered in {wait:g}s")
    if not box:
        raise UsageError(f"{host}:{port} is not a psserver RPC port (it accepted the connection but never answered "
                         f"the rendezvous handshake in {_SILENT_S:g}s): point --server at the --port of psserver serve")
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
