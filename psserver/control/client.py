"""``ControlClient``: the Python client of the control plane.

Used by ``psserver status|checkpoint|stop`` and by tests. Every gRPC failure becomes a
:class:`ControlError` (a :class:`~psserver.errors.UsageError`, so the CLI prints one line and
exits 2); an unreachable server is :class:`ControlUnavailable`
(a :class:`~psserver.errors.ServerUnavailable`). Methods return the protobuf messages of
``psserver.control.v1.control_pb2``; :mod:`psserver.control.convert` turns them into dicts.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psserver.config.common import parse_host_port, read_token_file, refuse_special_file
from psserver.config.control import TOKEN_ENV
from psserver.control import ADDRESS_ENV, DEFAULT_ADDRESS
from psserver.control.auth import check_token
from psserver.control.v1 import control_pb2 as pb
from psserver.control.v1 import control_pb2_grpc as pb_grpc
from psserver.errors import ServerUnavailable, UsageError

log = logging.getLogger(__name__)

T = TypeVar("T")

_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


class ControlError(UsageError):
    """A control-plane call failed; ``code`` is the gRPC status code."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


class ControlUnavailable(ControlError, ServerUnavailable):
    """The control plane cannot be reached (or did not answer in time)."""


def default_address() -> str:
    return os.environ.get(ADDRESS_ENV) or DEFAULT_ADDRESS


def read_token(token_file: Path | str | None, local_address: str | None = None) -> str | None:
    """The token from ``token_file``, else ``$PSSERVER_AUTH_TOKEN``, else (given
    ``local_address``) the local admin token a server of this user on this host wrote for that
    address (:mod:`psserver.control.local_token`), else None."""
    if token_file is not None:
        try:
            token = read_token_file(token_file, "--auth-token-file")
        except ValueError as e:
            raise UsageError(str(e)) from None
        return check_token(token, f"--auth-token-file {token_file}")
    token = check_token(os.environ.get(TOKEN_ENV) or None, f"${TOKEN_ENV}")
    if token is None and local_address is not None:
        from psserver.control.local_token import find_local_token

        token = find_local_token(local_address)
    return token


def open_channel(address: str, tls_ca: Path | str | bytes | None = None, options: Sequence[tuple[str, Any]] = ()
                 ) -> grpc.Channel:
    """A channel to ``address``: TLS verified against ``tls_ca`` (PEM bytes or a file) when given."""
    if tls_ca is None:
        return grpc.insecure_channel(address, options=list(options))
    if isinstance(tls_ca, bytes):
        ca = tls_ca
    else:
        try:
            refuse_special_file(tls_ca, "--tls-ca")
        except ValueError as e:
            raise UsageError(str(e)) from None
        try:
            ca = Path(tls_ca).read_bytes()
        except OSError as e:
            raise UsageError(f"cannot read --tls-ca {tls_ca}: {e.strerror or e}") from e
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca), options=list(options))


class ControlClient:
    """A channel to one control plane. Close it (or use ``with``) when done."""

    def __init__(
        self,
        address: str | None = None,
        token: str | None = None,
        tls_ca: Path | str | bytes | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.address = address or default_address()
        self.timeout = timeout
        token = check_token(token, "the control client's token")
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._tls = tls_ca is not None
        self._channel = open_channel(self.address, tls_ca)
        self._stub = pb_grpc.ControlServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    # ---- plumbing -----------------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _error(self, e: grpc.RpcError, what: str) -> ControlError:
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        details = (e.details() if hasattr(e, "details") else None) or str(code)
        if code in _UNREACHABLE:
            answer = None if self._tls else _probe_http2(self.address)
            if answer is not None:
                return ControlUnavailable(f"{self.address} is not a psserver control plane ({answer})", code)
            return ControlUnavailable(
                f"control plane at {self.address} unreachable ({code.name}: {_first_line(details)})", code
            )
        if code == grpc.StatusCode.CANCELLED:  # not by us: the server cancels calls as it stops
            return ControlUnavailable(f"control plane at {self.address} is stopping ({what} cancelled)", code)
        return ControlError(f"{what} failed: {code.name}: {_first_line(details)}", code)

    def _unary(self, what: str, method: Callable[..., T], request: Any, timeout: float | None) -> T:
        try:
            return method(request, timeout=self.timeout if timeout is None else timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(e, what) from None

    # ---- API ----------------------------------------------------------------------------

    def get_status(self, timeout: float | None = None) -> pb.ServerStatus:
        return self._unary("GetStatus", self._stub.GetStatus, pb.GetStatusRequest(), timeout)

    def list_trainers(self, timeout: float | None = None) -> list[pb.Trainer]:
        return list(self._unary("ListTrainers", self._stub.ListTrainers, pb.ListTrainersRequest(), timeout).trainers)

    def checkpoint(self, timeout: float | None = None) -> pb.CheckpointInfo:
        return self._unary("Checkpoint", self._stub.Checkpoint, pb.CheckpointRequest(), timeout).checkpoint

    def shutdown(self, reason: str = "", timeout: float | None = None) -> int:
        """Ask the server to drain and exit; returns its state (a ``pb.ServerState`` value)."""
        return self._unary("Shutdown", self._stub.Shutdown, pb.ShutdownRequest(reason=reason), timeout).state

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """``SERVING``, ``NOT_SERVING`` or ``SERVICE_UNKNOWN``; needs no token."""
        try:
            resp = self._health.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=self.timeout if timeout is None else timeout
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                return "SERVICE_UNKNOWN"
            raise self._error(e, "Health.Check") from None
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def watch(self, interval: float = 1.0) -> Iterator[pb.ServerStatus]:
        """Status every ``interval`` s until the server ends the stream; ``close()`` the
        generator (or break out of the loop) to cancel. No deadline: it runs until then."""
        call = self._stub.WatchStatus(pb.WatchStatusRequest(interval_seconds=interval), metadata=self._metadata)
        try:
            yield from call
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.CANCELLED and call.cancelled():
                return  # we cancelled it
            raise self._error(e, "WatchStatus") from None
        finally:
            call.cancel()


_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # + SETTINGS


def _probe_http2(address: str, wait: float = 1.0) -> str | None:
    """Why ``address`` is not a gRPC (HTTP/2) server although it accepts connections, else None
    (it speaks HTTP/2, or nothing listens: plain 'unreachable' then). An HTTP/2 server answers a
    client's preface with its SETTINGS frame at once, however busy its handlers are."""
    try:
        sock = socket.create_connection(parse_host_port(address), timeout=wait)
    except (OSError, ValueError):  # nothing listens, or no route: unreachable indeed
        return None
    reply = b""
    with sock:
        try:
            sock.sendall(_HTTP2_PREFACE)
            while len(reply) < 9:
                chunk = sock.recv(9 - len(reply))
                if not chunk:
                    break
                reply += chunk
        except TimeoutError:
            reply = reply or b"?"  # accepted, then silent: it waits for a protocol of its own
        except OSError:  # reset: it took the connection and dropped it
            pass
    if len(reply) >= 4 and reply[3] == 0x04:
        return None
    if reply[:1] in (b"\x15", b"\x16"):
        return "it answers with TLS: pass --tls-ca"
    if not reply:  # what a TLS server does with a plaintext preface, too
        return ("it closes connections without a gRPC answer; is it the RPC port, or a control plane with TLS "
                "(--tls-ca)?")
    return "it accepts connections but does not speak gRPC; is it the RPC port?"


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text and text.strip() else ""
