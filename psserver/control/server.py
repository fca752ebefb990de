"""``ControlServer``: the gRPC server of the control plane, as a context manager.

It binds ``config.host:config.port`` (port 0 picks a free one, see :attr:`ControlServer.port`),
serves ``psserver.v1.ControlService``, the standard ``grpc.health.v1.Health`` (NOT_SERVING
until ``target.ready`` is set, NOT_SERVING again once it is cleared or the server stops) and,
with ``config.reflection``, server reflection. Plaintext unless ``tls_cert``/``tls_key``.
"""

from __future__ import annotations

import logging
import re
import secrets
import ssl
import threading
from concurrent import futures
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from psserver.config.control import READ_TOKEN_ENV, TOKEN_ENV, ControlConfig
from psserver.control import SERVICE_NAME, WEIGHTS_SERVICE_NAME
from psserver.control.auth import AuthInterceptor, CallLogInterceptor, check_token
from psserver.control.local_token import LocalToken
from psserver.control.service import ControlService, add_to_server
from psserver.control.weights import WeightsService, WeightsSource
from psserver.control.weights import add_to_server as add_weights_to_server
from psserver.errors import UsageError
from psserver.telemetry import ControlTarget

log = logging.getLogger(__name__)

HEALTH_SERVICES = ("", SERVICE_NAME)
LOOPBACK = {"127.0.0.1", "::1", "localhost", "[::1]"}


def check_tls_files(cert: Path, key: Path | None) -> None:
    """``UsageError`` unless ``cert`` and ``key`` are a PEM certificate and its private key
    (gRPC would only fail to bind, which reads like a port in use)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as e:
        detail = re.sub(r"^\[\w+\]\s*|\s*\(_ssl\.c:\d+\)$", "", str(e.args[1] if len(e.args) > 1 else e))
        raise UsageError(f"--tls-cert {cert} and --tls-key {key} are not a PEM certificate and its private key "
                         f"({detail})") from None
    except OSError as e:
        raise UsageError(f"cannot read --tls-cert {cert} or --tls-key {key}: {e.strerror or e}") from None


def format_address(host: str, port: int) -> str:
    """``host:port``, with IPv6 literals in brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


class ControlServer:
    """Serves the control plane of ``target`` while in the ``with`` block.

    Health follows ``target.ready`` by itself (polled every ``poll_interval`` s, a cheap
    ``Event.is_set``); :meth:`set_serving` overrides it at once, e.g. right after ``ready`` is
    set, to avoid the poll delay.
    """

    def __init__(
        self,
        target: ControlTarget,
        config: ControlConfig | None = None,
        *,
        max_workers: int = 16,
        max_watchers: int = 8,
        grace: float = 2.0,
        poll_interval: float = 0.1,
        weights: WeightsSource | None = None,
        max_reads: int = 32,
    ) -> None:
        """``weights``: what ``WeightsService`` reads versions of the model from (None: it is
        not served); at most ``max_reads`` reads at once, on workers of their own."""
        self.target = target
        self.config = config or ControlConfig()
        self.grace = grace
        self.poll_interval = poll_interval
        self.weights = WeightsService(weights, max_reads) if weights is not None else None
        self._max_workers = max_workers + (max_reads if weights is not None else 0)
        # Keep workers free for unary calls however many streams are open.
        self.service = ControlService(target, max_watchers=min(max_watchers, max(1, max_workers - 4)))
        self.health = health.HealthServicer()
        self._set_health(False)
        self._serving: bool | None = False
        self._server: grpc.Server | None = None
        self._stop = threading.Event()
        self._poller: threading.Thread | None = None
        self._lock = threading.Lock()
        self.port: int = 0
        self.tls = self.config.tls_cert is not None
        self.local_token: LocalToken | None = None
        """The private file of the admin token, when no token is configured (see auth)."""

    @property
    def address(self) -> str:
        return format_address(self.config.host, self.port)

    # ---- life cycle ---------------------------------------------------------------------

    def start(self) -> ControlServer:
        cfg = self.config
        token = check_token(cfg.token(), f"--auth-token-file {cfg.auth_token_file}"
                            if cfg.auth_token_file is not None else f"${TOKEN_ENV}")
        # Without a configured token, Checkpoint and Shutdown take a random one that only this
        # user can read on this host (psserver.control.local_token), else nobody could use them.
        admin_token = secrets.token_urlsafe(32) if not token and not cfg.allow_unauthenticated_admin else None
        read_token = check_token(cfg.read_token(), f"--read-token-file {cfg.read_token_file}"
                                 if cfg.read_token_file is not None else f"${READ_TOKEN_ENV}")
        auth = AuthInterceptor(token, allow_unauthenticated_admin=cfg.allow_unauthenticated_admin,
                               admin_token=admin_token, read_token=read_token)
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=self._max_workers, thread_name_prefix="psserver-control"),
            interceptors=[CallLogInterceptor(), auth],
            # Without this gRPC sets SO_REUSEPORT and a second server would silently share the
            # port (and half the calls) instead of failing to bind.
            options=[("grpc.so_reuseport", 0)],
        )
        add_to_server(self.service, server)
        if self.weights is not None:
            add_weights_to_server(self.weights, server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        if cfg.reflection:
            from grpc_reflection.v1alpha import reflection

            names = (SERVICE_NAME, *((WEIGHTS_SERVICE_NAME,) if self.weights else ()), health.SERVICE_NAME,
                     reflection.SERVICE_NAME)
            reflection.enable_server_reflection(names, server)
        bind = format_address(cfg.host, cfg.port)
        if cfg.tls_cert is not None:
            check_tls_files(cfg.tls_cert, cfg.tls_key)
        try:
            if cfg.tls_cert is not None:
                creds = grpc.ssl_server_credentials([(cfg.tls_key.read_bytes(), cfg.tls_cert.read_bytes())])
                port = server.add_secure_port(bind, creds)
            else:
                port = server.add_insecure_port(bind)
        except RuntimeError as e:
            raise UsageError(f"control plane cannot listen on {bind}: {e} (port in use? try --control-port 0)") from e
        if not port:
            raise UsageError(f"control plane cannot listen on {bind} (port in use? try --control-port 0)")
        self.port = port
        if admin_token is not None:
            try:
                self.local_token = LocalToken.write(cfg.host, port, admin_token)
            except UsageError as e:  # serve all the same: training does not stop for its admin commands
                auth.forget_admin_token()
                log.warning("no local admin token, so checkpoint and stop over the control plane are refused: %s", e)
        server.start()
        self._server = server
        self._stop.clear()
        log.info(
            "control plane listening on %s (%s, %s%s%s)",
            self.address,
            "TLS" if self.tls else "plaintext",
            "token required" if token else
            f"admin token for this user in {self.local_token.path}" if self.local_token else "no token",
            "" if self.weights is None else ", weights for readers" + (" with their token" if read_token else ""),
            ", reflection" if cfg.reflection else "",
        )
        if cfg.host not in LOOPBACK:
            if not token:
                log.warning(
                    "control plane on %s has no token: anyone who can reach it can read its status%s",
                    cfg.host, " and stop it" if cfg.allow_unauthenticated_admin else "",
                )
            elif not self.tls:
                log.warning("control plane on %s without TLS: the token travels in clear text", cfg.host)
        self._check_ready()  # right from the first call, not one poll later
        self._poller = threading.Thread(target=self._poll_ready, name="psserver-control-health", daemon=True)
        self._poller.start()
        return self

    def stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, WatchStatus streams end, then the gRPC server stops."""
        with self._lock:
            server, self._server = self._server, None
        if server is None:
            return
        try:
            self._stop.set()
            self.set_serving(False)
            self.health.enter_graceful_shutdown()  # NOT_SERVING everywhere, and no way back
            self.service.close()
            if self.weights is not None:
                self.weights.close()
        finally:
            server.stop(self.grace if grace is None else grace).wait()
            if self.local_token is not None:
                self.local_token.remove()
                self.local_token = None
            if self._poller is not None:
                self._poller.join(timeout=1.0)
            log.info("control plane on %s stopped", self.address)

    def __enter__(self) -> ControlServer:
        # A server started already (``with ControlServer(...).start()``) is not started twice:
        # the first gRPC server, and its token file, would be left behind.
        return self if self._server is not None else self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # ---- health -------------------------------------------------------------------------

    def set_serving(self, serving: bool) -> None:
        """Set health now (the ``ready`` poll would do the same within ``poll_interval``)."""
        with self._lock:
            if self._serving == serving:
                return
            self._serving = serving
        self._set_health(serving)
        log.info("control plane health: %s", "SERVING" if serving else "NOT_SERVING")

    def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        # The whole server ("") says SERVING last and NOT_SERVING first: a client that saw it
        # SERVING finds the control service SERVING too (a CI run read between the two).
        for name in reversed(HEALTH_SERVICES) if serving else HEALTH_SERVICES:
            self.health.set(name, status)

    def _check_ready(self) -> None:
        ready = getattr(self.target, "ready", None)
        try:
            serving = bool(ready is not None and ready.is_set())
        except Exception:  # noqa: BLE001 - a broken target is not serving
            serving = False
        if serving != self._serving:
            self.set_serving(serving)

    def _poll_ready(self) -> None:
        while not self._stop.wait(self.poll_interval):
            self._check_ready()
