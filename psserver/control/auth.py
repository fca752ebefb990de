"""Server interceptors: bearer-token authentication and one log line per call.

Doing both here keeps every method of every service (ours, reflection) under the same rules
without each method remembering to check.

Status codes, by design:

* token configured, ``authorization`` metadata missing or not ``Bearer <token>``
  -> ``UNAUTHENTICATED`` ("missing bearer token");
* token configured, a well-formed but wrong token -> ``UNAUTHENTICATED`` ("invalid bearer
  token"): the caller has not proven who it is, which is what UNAUTHENTICATED means;
  ``PERMISSION_DENIED`` is kept for "we know the call is not allowed";
* no token configured, ``Checkpoint``/``Shutdown`` -> ``PERMISSION_DENIED`` unless
  ``--allow-unauthenticated-admin``, or unless they carry the server's local admin token
  (:mod:`psserver.control.local_token`: a private file that only the server's own user on its
  host can read; a wrong one is ``UNAUTHENTICATED``): mutating the server anonymously is
  refused by policy, reads stay open;
* ``WeightsService`` (the model's weights, for readers): the read token
  (``--read-token-file``) or the control token when either is configured, else open as the
  status reads. The read token opens nothing else: on ``ControlService`` it is a wrong token.

``grpc.health.v1.Health`` is always open (load balancers and kubelets probe it without
credentials) and is not logged (probes would flood the log).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from psserver.control import SERVICE_NAME, WEIGHTS_SERVICE_NAME
from psserver.errors import UsageError
from psserver.telemetry import CONTROL_REFUSALS, RefusalLog

log = logging.getLogger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
ADMIN_METHODS = frozenset({f"/{SERVICE_NAME}/Checkpoint", f"/{SERVICE_NAME}/Shutdown"})
# Successful reads are polled (scripts, ``status --watch``): log them at DEBUG only.
QUIET_METHODS = frozenset({f"/{SERVICE_NAME}/GetStatus", f"/{SERVICE_NAME}/ListTrainers",
                           f"/{WEIGHTS_SERVICE_NAME}/Read", f"/{WEIGHTS_SERVICE_NAME}/Rows",
                           f"/{WEIGHTS_SERVICE_NAME}/RowsSince"})
WEIGHTS_PREFIX = f"/{WEIGHTS_SERVICE_NAME}/"

# gRPC metadata values are printable ASCII, and its default limit on all of a call's metadata
# is 8 KiB: a longer token is RESOURCE_EXHAUSTED on every call.
MAX_TOKEN_LENGTH = 4096


def check_token(token: str | None, source: str) -> str | None:
    """``token`` if gRPC metadata can carry it (``Bearer <token>``); else ``UsageError`` naming
    ``source`` (the file or variable it came from) and why. Both sides read tokens through it:
    a server must not start with a token no client can send."""
    if token is None:
        return None
    why = None
    bad = next((c for c in token if not " " <= c <= "~"), None)
    if bad is not None:
        kind = "a non-ASCII character" if ord(bad) > 127 else f"a control character ({bad!r})"
        why = f"it holds {kind}"
    elif len(token) > MAX_TOKEN_LENGTH:
        why = f"it is {len(token)} characters long"
    if why is None:
        return token
    raise UsageError(f"{source}: unusable bearer token: {why}; a token is printable ASCII, "
                     f"at most {MAX_TOKEN_LENGTH} characters")


def _digest(token: str) -> bytes:
    # Hash first so that compare_digest does not even leak the token's length.
    return hashlib.sha256(token.encode("utf-8")).digest()


def bearer_token(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """The token of the first ``authorization: Bearer <token>`` entry, else None."""
    for key, value in metadata or ():
        if key.lower() != "authorization":
            continue
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        scheme, _, token = str(value).strip().partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return None
    return None


def _handler_kind(handler: grpc.RpcMethodHandler) -> str:
    if handler.request_streaming:
        return "stream_stream" if handler.response_streaming else "stream_unary"
    return "unary_stream" if handler.response_streaming else "unary_unary"


def _rebuild(handler: grpc.RpcMethodHandler, behavior: Callable, *, raw_request: bool = False) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` whose behavior is ``behavior``."""
    kind = _handler_kind(handler)
    factory = getattr(grpc, f"{kind}_rpc_method_handler")
    return factory(
        behavior,
        request_deserializer=None if raw_request else handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _denied(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler that refuses the call; the request is never parsed (raw bytes)."""

    def abort(request_or_iterator: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, details)

    return _rebuild(handler, abort, raw_request=True)


class AuthInterceptor(grpc.ServerInterceptor):
    """Checks ``authorization: Bearer <token>`` on every call but health (see module doc)."""

    def __init__(self, token: str | None, *, allow_unauthenticated_admin: bool = False,
                 admin_token: str | None = None, read_token: str | None = None) -> None:
        self._digest = _digest(token) if token else None
        self._read_digest = _digest(read_token) if read_token else None
        self._allow_admin = allow_unauthenticated_admin
        self._admin_digest = _digest(admin_token) if admin_token and not token else None

    def forget_admin_token(self) -> None:
        """No local admin token after all (its file could not be written): admin calls are
        refused, saying how to configure a token."""
        self._admin_digest = None

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler  # unknown method: UNIMPLEMENTED from gRPC itself
        if method.startswith(WEIGHTS_PREFIX):
            return self._reader(handler, handler_call_details)
        if self._digest is not None:
            presented = bearer_token(handler_call_details.invocation_metadata)
            if presented is None:
                return _denied(
                    handler,
                    grpc.StatusCode.UNAUTHENTICATED,
                    "missing bearer token: send metadata 'authorization: Bearer <token>' "
                    "(psserver: --auth-token-file or $PSSERVER_AUTH_TOKEN)",
                )
            if not hmac.compare_digest(_digest(presented), self._digest):
                return _denied(handler, grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        elif method in ADMIN_METHODS and not self._allow_admin:
            return self._admin(handler, handler_call_details)
        return handler

    def _reader(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        """A read of the weights: the read token or the control token when either is configured."""
        accepted = [d for d in (self._read_digest, self._digest) if d is not None]
        if not accepted:
            return handler
        presented = bearer_token(details.invocation_metadata)
        if presented is None:
            return _denied(handler, grpc.StatusCode.UNAUTHENTICATED,
                           "missing bearer token: send metadata 'authorization: Bearer <token>' (psserver: "
                           "--read-token-file or $PSSERVER_READ_TOKEN)")
        digest = _digest(presented)
        matches = sum(hmac.compare_digest(digest, d) for d in accepted)  # both compared, always
        if not matches:
            return _denied(handler, grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        return handler

    def _admin(self, handler: grpc.RpcMethodHandler, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        """An admin call to a server without a configured token: only with its local admin token."""
        presented = bearer_token(details.invocation_metadata) if self._admin_digest is not None else None
        if presented is not None:
            if hmac.compare_digest(_digest(presented), self._admin_digest):
                return handler
            return _denied(handler, grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")
        if self._admin_digest is not None:
            why = ("Checkpoint and Shutdown need the server's local admin token, which only the psserver CLI of "
                   "the user who started the server, on its host, finds; or start the server with "
                   "--auth-token-file (or $PSSERVER_AUTH_TOKEN) and pass the same")
        else:
            why = ("Checkpoint and Shutdown need authentication: start the server with --auth-token-file "
                   "(or $PSSERVER_AUTH_TOKEN), or with --allow-unauthenticated-admin")
        return _denied(handler, grpc.StatusCode.PERMISSION_DENIED, why)


class CallLogInterceptor(grpc.ServerInterceptor):
    """Logs method, peer, status code and duration of every call when it ends.

    Put it first in the interceptor list so that it also sees calls refused by
    :class:`AuthInterceptor`.
    """

    def __init__(self, logger: logging.Logger = log, refusals: RefusalLog = CONTROL_REFUSALS) -> None:
        self._log = logger
        self._refusals = refusals

    def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails):
        method = handler_call_details.method
        handler = continuation(handler_call_details)
        if handler is None:
            self._log.info("grpc %s -> UNIMPLEMENTED (unknown method)", method)
            return None
        if method.startswith(HEALTH_PREFIX):
            # Left untouched: health's Watch relies on attributes of its own behavior
            # (experimental_non_blocking) that a wrapper would hide.
            return handler
        kind = _handler_kind(handler)
        behavior = getattr(handler, kind)
        if handler.response_streaming:
            wrapped = self._wrap_stream(method, behavior)
        else:
            wrapped = self._wrap_unary(method, behavior)
        return _rebuild(handler, wrapped)

    def _done(self, method: str, context: grpc.ServicerContext, t0: float, error: BaseException | None) -> None:
        code = _code_of(context, error)
        level = logging.INFO
        if code == grpc.StatusCode.OK and method in QUIET_METHODS:
            level = logging.DEBUG
        elif code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
            log_it, suppressed = self._refusals.refused(code.name)
            if not log_it:
                return
            if suppressed:
                self._log.warning("grpc: %d more refused calls not logged (rate limit; counted in "
                                  "psserver_control_refusals_total)", suppressed)
            level = logging.WARNING
        elif code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL):
            level = logging.ERROR
        if self._log.isEnabledFor(level):
            ms = (time.monotonic() - t0) * 1e3
            self._log.log(level, "grpc %s from %s -> %s in %.1f ms", method, context.peer(), code.name, ms)

    def _wrap_unary(self, method: str, behavior: Callable) -> Callable:
        def call(request: Any, context: grpc.ServicerContext) -> Any:
            t0 = time.monotonic()
            error: BaseException | None = None
            try:
                return behavior(request, context)
            except BaseException as e:
                error = e
                raise
            finally:
                self._done(method, context, t0, error)

        return call

    def _wrap_stream(self, method: str, behavior: Callable) -> Callable:
        def call(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            t0 = time.monotonic()
            error: BaseException | None = None
            try:
                yield from behavior(request, context)
            except BaseException as e:
                error = e
                raise
            finally:
                self._done(method, context, t0, error)

        return call


def _code_of(context: grpc.ServicerContext, error: BaseException | None) -> grpc.StatusCode:
    """The status the call ends with, as far as the server can tell from inside."""
    code = None
    try:
        code = context.code()  # set by abort() / set_code()
    except Exception:  # noqa: BLE001 - older grpc or a foreign context
        pass
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(error, GeneratorExit) or (error is None and not context.is_active()):
        return grpc.StatusCode.CANCELLED
    if error is not None:
        return grpc.StatusCode.UNKNOWN
    return grpc.StatusCode.OK
