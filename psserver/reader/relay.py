"""A relay of the weights: a reader that serves each version it reads again, to readers of other
hosts, so that the server sends each version once per relay it feeds, whatever the number of
readers behind them (``psserver relay``; readers point ``psserver.read`` at it as at a server).

Relays make a tree or a chain: a relay's upstream is the server or another relay. Each keeps
the newest version it has whole (one step, never a mix of two: it is read whole and replaced
whole) and answers ``WeightsService`` as the server does: ``Read`` (newest, or waiting for one
past a step), ``Rows`` and ``RowsSince`` (passed on to its upstream, never cached: a lookup is
of the rows as held). A version's ``published_at`` is moved to this relay's clock, so a reader
behind it measures the version's age from the server's step, across every hop.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

from psserver.common.versions import Version
from psserver.control.auth import AuthInterceptor, CallLogInterceptor
from psserver.control.server import LOOPBACK, check_tls_files, format_address
from psserver.control.weights import WeightsService
from psserver.control.weights import add_to_server as add_weights_to_server
from psserver.errors import NoVersion, ServerUnavailable, UsageError
from psserver.reader.reader import Reader, resolve_read_token

log = logging.getLogger(__name__)

RETRY_S = 1.0
"""How long a relay that lost its upstream waits before it asks again."""


class Relay:
    """Versions of ``upstream`` (the server's control plane, or another relay) served on
    ``host:port`` (0: a free port, in :attr:`port` once started) to readers that hold
    ``read_token`` (given, or read from ``read_token_file``, else ``$PSSERVER_READ_TOKEN``; none:
    open, as a server without one); ``upstream_token``: the token this relay reads its upstream
    with (else ``$PSSERVER_READ_TOKEN`` too). Weights that need a token upstream are served beyond loopback
    only with a token of this relay's, or ``open=True``; ``tls_cert``/``tls_key``: serve TLS."""

    def __init__(self, upstream: str | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 upstream_token: str | None = None, upstream_token_file: Path | str | None = None,
                 read_token: str | None = None, read_token_file: Path | str | None = None,
                 tls_ca: Path | str | bytes | None = None, tls_cert: Path | str | None = None,
                 tls_key: Path | str | None = None, open: bool = False, name: str = "relay",  # noqa: A002
                 max_reads: int = 32, timeout: float = 30.0) -> None:
        if (tls_cert is None) != (tls_key is None):
            raise UsageError("--tls-cert and --tls-key go together")
        self._tls = None if tls_cert is None else (Path(tls_cert), Path(tls_key))  # type: ignore[arg-type]
        if self._tls is not None:
            check_tls_files(*self._tls)
        self._read_token = resolve_read_token(read_token, read_token_file)
        self._reader = Reader(upstream, token=upstream_token, token_file=upstream_token_file, tls_ca=tls_ca,
                              name=name, timeout=timeout)
        self.upstream = self._reader.address
        self.host, self.port = host, port
        if self._reader.has_token and self._read_token is None and host not in LOOPBACK and not open:
            self._reader.close()
            raise UsageError(f"the weights of {self.upstream} need a token, and this relay would serve them "
                             f"to anyone who reaches {host}: give its readers a token (--read-token-file), or pass "
                             "--open to mean it")
        self.max_reads = max_reads
        self._cond = threading.Condition()
        self._latest: Version | None = None
        self._model = ""
        self._closed = False
        self._server: grpc.Server | None = None
        self._thread: threading.Thread | None = None
        self.fetched = 0
        """Versions read from upstream."""
        self.served = 0
        """Versions sent whole to readers of this relay."""

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    def start(self) -> Relay:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self.max_reads + 4,
                                                        thread_name_prefix="psserver-relay"),
                             interceptors=[CallLogInterceptor(), AuthInterceptor(None, read_token=self._read_token)],
                             options=[("grpc.so_reuseport", 0)])
        add_weights_to_server(WeightsService(self, self.max_reads), server)
        try:
            bind = format_address(self.host, self.port)
            if self._tls is not None:
                cert, key = self._tls
                creds = grpc.ssl_server_credentials([(key.read_bytes(), cert.read_bytes())])
                port = server.add_secure_port(bind, creds)
            else:
                port = server.add_insecure_port(bind)
        except RuntimeError as e:
            raise UsageError(f"cannot listen on {self.address} ({e})") from None
        if not port:
            raise UsageError(f"cannot listen on {self.address} (in use?)")
        self.port = port
        server.start()
        self._server = server
        self._thread = threading.Thread(target=self._follow, name="psserver-relay-follow", daemon=True)
        self._thread.start()
        log.info("relaying the weights of %s on %s (%s, %s)", self.upstream, self.address,
                 "TLS" if self._tls else "plaintext", "readers' token required" if self._read_token else "open")
        if self.host not in LOOPBACK and self._read_token is not None and self._tls is None:
            log.warning("relay on %s without TLS: its readers' token and the weights travel in clear text", self.host)
        return self

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._server is not None:
            self._server.stop(grace=1.0).wait(timeout=5.0)
        if self._thread is not None:  # its wait for a version ends within RETRY_S * 2 (daemon past that)
            self._thread.join(timeout=RETRY_S * 2 + 3.0)
        self._reader.close()

    def __enter__(self) -> Relay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _follow(self) -> None:
        """Read each new version of upstream whole, until closed (a lost upstream is asked again)."""
        step: int | None = None
        said = False
        while not self._closed:
            try:
                version = self._reader.latest() if step is None else self._reader.wait(step, timeout=RETRY_S * 2)
            except (UsageError, ServerUnavailable) as e:
                if not said:
                    log.warning("relay: no version from %s (%s); asking again every %gs", self.upstream, e, RETRY_S)
                    said = True
                with self._cond:
                    self._cond.wait(RETRY_S)
                continue
            if version is None:
                continue
            if said:
                log.info("relay: %s answers again", self.upstream)
                said = False
            # The upstream's clock minus this one's: published_at on this relay's clock.
            offset = version.received_at - time.time()
            with self._cond:
                self._latest = Version(version.step, version.published_at - offset, version.state,
                                       history=version.history)
                self._model = version.model
                self.fetched += 1
                self._cond.notify_all()
            step = version.step

    # ---- what WeightsService reads (psserver.control.weights.WeightsSource) ------------------

    def read(self, newer_than: int | None, timeout: float, history: str = "") -> Version | None:
        deadline = time.monotonic() + timeout
        floor = -1 if newer_than is None else newer_than
        with self._cond:
            while not self._closed and (self._latest is None or (
                    self._latest.step <= floor and not (history and history != self._latest.history))):
                left = deadline - time.monotonic()
                if left <= 0:
                    if self._latest is None and newer_than is None:
                        raise NoVersion(f"the relay has no version of {self.upstream} yet", later=True)
                    return None
                self._cond.wait(left)
            return None if self._closed else self._latest

    def read_done(self, name: str, peer: str, version: Version, sharing: int = 1, nbytes: int = 0) -> float:
        with self._cond:
            self.served += 1
        return max(0.0, time.time() - version.published_at)

    def model_name(self) -> str:
        return self._model

    def rows(self, table: str, ids: Any) -> tuple[int, Any]:
        try:
            got = self._reader.rows(table, ids)
        except UsageError as e:
            raise _passed_on(e) from None
        return got.step, got.values

    def rows_since(self, table: str, since: int) -> Any:
        try:
            return self._reader.rows_since(table, since)
        except UsageError as e:
            raise _passed_on(e) from None


def _passed_on(e: UsageError) -> Exception:
    """The upstream's refusal of a row read, as the relay's own (the same gRPC code)."""
    text = str(e)
    return ValueError(text) if "INVALID_ARGUMENT" in text else NoVersion(text)
