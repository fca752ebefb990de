"""The metrics endpoint's bounds, with real sockets: a connection past its deadline or past
the cap is closed, an oversized request head is refused, and scrapes answer as
``prometheus_client``'s own server does."""

from __future__ import annotations

import gzip
import socket
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry, Counter

from psserver.utils.metrics_http import MAX_REQUEST_BYTES, MetricsHTTPServer


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("a", "first", registry=registry).inc(3)
    Counter("b", "second", registry=registry).inc()
    return registry


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (read to its end; the socket's timeout bounds the wait)."""
    s.settimeout(10)
    while True:
        data = s.recv(65536)
        if not data:
            return True


def test_a_connection_that_never_finishes_its_request_is_closed_at_its_deadline(registry):
    server = MetricsHTTPServer("127.0.0.1", 0, registry, timeout_s=0.2)
    try:
        with socket.create_connection(server.server_address) as s:
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            assert closed_by_server(s)
        assert server.open_connections == 0
    finally:
        server.close()
    assert not server.thread.is_alive()


def test_past_the_cap_the_oldest_connection_is_closed(registry):
    server = MetricsHTTPServer("127.0.0.1", 0, registry, max_connections=2)
    try:
        first = socket.create_connection(server.server_address)
        others = [socket.create_connection(server.server_address) for _ in range(2)]
        assert closed_by_server(first)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/metrics", timeout=10) as r:
            assert b"a_total 3.0" in r.read()
        for s in [first, *others]:
            s.close()
    finally:
        server.close()


def test_answers_as_prometheus_clients_server(registry):
    server = MetricsHTTPServer("127.0.0.1", 0, registry)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with urllib.request.urlopen(f"{url}/metrics?name[]=b_total", timeout=10) as r:
            text = r.read().decode()
            assert r.headers["Content-Type"].startswith("text/plain") and "b_total 1.0" in text
            assert "a_total" not in text
        request = urllib.request.Request(f"{url}/metrics", headers={"Accept-Encoding": "gzip"})
        with urllib.request.urlopen(request, timeout=10) as r:
            assert r.headers["Content-Encoding"] == "gzip" and b"a_total 3.0" in gzip.decompress(r.read())
        with pytest.raises(urllib.error.HTTPError, match="405"):
            urllib.request.urlopen(urllib.request.Request(f"{url}/metrics", method="POST", data=b""), timeout=10)
        with socket.create_connection(server.server_address) as s:
            s.sendall(b"GET /" + b"x" * MAX_REQUEST_BYTES)
            s.settimeout(10)
            assert s.recv(100).startswith(b"HTTP/1.1 431 ")
        with socket.create_connection(server.server_address) as s:
            s.sendall(b"nonsense\r\n\r\n")
            s.settimeout(10)
            assert s.recv(100).startswith(b"HTTP/1.1 400 ")
    finally:
        server.close()
