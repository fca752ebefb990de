"""The HTTP endpoint of a Prometheus registry, bounded: one thread, a cap on open connections,
a deadline per connection.

``prometheus_client.start_http_server`` starts a thread per connection and waits on each for
ever: a client that opens connections and sends nothing (or a byte now and then) holds one
thread each, without limit (300 such connections: 369 threads in a server). Here one thread
serves every connection with a selector: a connection costs a socket and its buffer, never a
thread; at most :data:`MAX_CONNECTIONS` are open (a new one closes the oldest), each must have
sent its request and read the answer within :data:`CONNECTION_TIMEOUT_S`, and a request head
is at most :data:`MAX_REQUEST_BYTES`. A scrape is answered as ``prometheus_client``'s own
server answers it (text or OpenMetrics by ``Accept``, gzip by ``Accept-Encoding``,
``?name[]=`` filters), then the connection closes.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 64
"""Open connections at most; Prometheus scrapes over one at a time per target."""
CONNECTION_TIMEOUT_S = 10.0
"""From accept to the last byte of the answer (Prometheus's own default scrape timeout)."""
MAX_REQUEST_BYTES = 16 * 1024
"""A request line and its headers; a scrape's are a few hundred bytes."""


@dataclass
class _Connection:
    sock: socket.socket
    deadline: float
    received: bytearray = field(default_factory=bytearray)
    answer: bytes = b""
    sent: int = 0


class MetricsHTTPServer:
    """Serves ``registry`` on ``host:port`` (0: any free port; ``server_address`` says which)
    from one daemon thread until :meth:`close`. ``OSError`` when the address cannot be bound."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry, *, max_connections: int = MAX_CONNECTIONS,
                 timeout_s: float = CONNECTION_TIMEOUT_S) -> None:
        self.registry = registry
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
        self._listener = socket.create_server(address[:2], family=family, backlog=128)
        self._listener.setblocking(False)
        self.server_address = self._listener.getsockname()
        self._wake_read, self._wake_write = socket.socketpair()
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._selector.register(self._wake_read, selectors.EVENT_READ)
        self._connections: dict[socket.socket, _Connection] = {}  # oldest first
        self._closing = False
        self.thread = threading.Thread(target=self._run, name="psserver-metrics-http", daemon=True)
        self.thread.start()

    @property
    def open_connections(self) -> int:
        return len(self._connections)

    def close(self) -> None:
        """Stop serving and close every socket (idempotent)."""
        if self._closing:
            return
        self._closing = True
        with contextlib.suppress(OSError):
            self._wake_write.send(b"x")
        self.thread.join(timeout=5)

    # ---- the serving thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closing:
                timeout = None
                if self._connections:
                    timeout = max(0.0, min(c.deadline for c in self._connections.values()) - time.monotonic())
                for key, events in self._selector.select(timeout):
                    if key.fileobj is self._listener:
                        self._accept()
                    elif key.fileobj is not self._wake_read:
                        self._serve(key.fileobj, events)  # type: ignore[arg-type]
                now = time.monotonic()
                for sock in [s for s, c in self._connections.items() if c.deadline <= now]:
                    self._drop(sock)
        except Exception:  # noqa: BLE001 - the metrics endpoint must never take the server down
            log.exception("the metrics endpoint stopped")
        finally:
            for sock in list(self._connections):
                self._drop(sock)
            for sock in (self._listener, self._wake_read, self._wake_write):
                with contextlib.suppress(OSError, KeyError, ValueError):
                    self._selector.unregister(sock)
                sock.close()
            self._selector.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of file descriptors, a connection reset before accept
                log.debug("metrics endpoint: accept failed: %s", e)
                return
            if len(self._connections) >= self.max_connections:
                self._drop(next(iter(self._connections)))  # the oldest: a fresh scrape gets through
            sock.setblocking(False)
            self._connections[sock] = _Connection(sock, time.monotonic() + self.timeout_s)
            self._selector.register(sock, selectors.EVENT_READ)

    def _serve(self, sock: socket.socket, events: int) -> None:
        conn = self._connections.get(sock)
        if conn is None:
            return
        try:
            if events & selectors.EVENT_READ and not conn.answer:
                chunk = sock.recv(65536)
                if not chunk:
                    self._drop(sock)
                    return
                conn.received += chunk
                end = conn.received.find(b"\r\n\r\n")
                if end < 0 and len(conn.received) <= MAX_REQUEST_BYTES:
                    return
                conn.answer = self._answer(bytes(conn.received[:end]) if end >= 0 else None)
                self._selector.modify(sock, selectors.EVENT_WRITE)
            if events & selectors.EVENT_WRITE or conn.answer:
                conn.sent += sock.send(conn.answer[conn.sent:])
                if conn.sent >= len(conn.answer):
                    self._drop(sock)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:  # the client went away
            self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        self._connections.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._selector.unregister(sock)
        sock.close()

    def _answer(self, head: bytes | None) -> bytes:
        """The whole HTTP answer to a request head (None: one past :data:`MAX_REQUEST_BYTES`)."""
        if head is None:
            return _response("431 Request Header Fields Too Large", [], b"")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _response("400 Bad Request", [], b"")
        method, target = parts[0], urlsplit(parts[1])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if method == "OPTIONS":
            return _response("200 OK", [("Allow", "OPTIONS,GET")], b"")
        if method != "GET":
            return _response("405 Method Not Allowed", [("Allow", "OPTIONS,GET")],
                             f"# HTTP 405 Method Not Allowed: {method[:20]}; use OPTIONS or GET\n".encode())
        if target.path == "/favicon.ico":
            return _response("200 OK", [], b"")
        try:
            encoder, content_type = choose_encoder(headers.get("accept"))
            registry = self.registry
            params = parse_qs(target.query)
            if "name[]" in params:
                registry = registry.restricted_registry(params["name[]"])
            body = encoder(registry)
        except Exception:  # noqa: BLE001 - a collector's bug answers 500, the endpoint goes on
            log.exception("metrics endpoint: a scrape failed")
            return _response("500 Internal Server Error", [], b"")
        extra = [("Content-Type", content_type)]
        if "gzip" in headers.get("accept-encoding", ""):
            body = gzip.compress(body)
            extra.append(("Content-Encoding", "gzip"))
        return _response("200 OK", extra, body)


def _response(status: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    head = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers), f"Content-Length: {len(body)}",
            "Connection: close", "", ""]
    return "\r\n".join(head).encode("latin-1") + body


__all__ = ["CONNECTION_TIMEOUT_S", "MAX_CONNECTIONS", "MAX_REQUEST_BYTES", "MetricsHTTPServer"]
