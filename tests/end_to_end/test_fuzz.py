"""Bytes from a stranger on the server's ports (store, control, metrics) while two trainers train.

Thousands of random and crafted byte strings (zeroes, huge length prefixes, HTTP, TLS
ClientHello, HTTP/2 frames, TCPStore commands cut short or with absurd sizes) from several
threads: the server never dies, the trainers finish and every one of their updates is applied
once, no more, no less. TensorPipe's own
listeners are not in this list: their crash is inside libtorch (``test_supervisor``).
"""

from __future__ import annotations

import random
import socket
import struct
import threading
import urllib.request

import pytest

from psserver.control.client import ControlClient
from tests.procs import free_port, slow_steps

ROUNDS = 700
"""Byte strings per port (three ports: about 2,100 connections)."""
STEPS, STEP_DELAY = 150, 0.2
"""Each trainer's steps on the synthetic data, slowed so that they outlast the bytes (30 s at least)."""

TLS_CLIENT_HELLO = bytes.fromhex(
    "16030100a5010000a10303" + "00" * 32 + "000020c02bc02fc02cc030cca9cca8c009c013c00ac014009c009d002f0035c012000a"
    "0100005800000018001600001366757a7a2e70737365727665722e746573740005000501000000000"
    "00a000a0008001d001700180019000b00020100000d0012001004010403050105030601060302010203ff010001000012000000")
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def payloads(rng: random.Random):
    """An endless mix of the byte strings a scanner, a misdirected client or an attacker sends."""
    crafted = [
        b"\0" * 16, b"\0" * 4096, b"\xff" * 64, b"GET / HTTP/1.0\r\n\r\n", b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST / HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\nabc", TLS_CLIENT_HELLO, HTTP2_PREFACE,
        HTTP2_PREFACE + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + b"\xff\xff\xff\x01\x05\x00\x00\x00\x01",
        struct.pack("<Q", 2**63 - 1) + b"x" * 8, struct.pack("<Q", 2**32) + b"x", struct.pack(">I", 2**31 - 1),
        struct.pack("<Q", 16) + b"\0" * 8,  # a length prefix whose frame never comes (truncated)
        b"\x00" + struct.pack("<Q", 2**40) + b"key",  # a store command with an absurd key length
        b"\x01" + struct.pack("<Q", 3) + b"key" + struct.pack("<Q", 2**62),  # SET with an absurd value length
        b"\x02" + struct.pack("<Q", 8), b"\x0a" * 9, bytes(range(256)),
    ]
    while True:
        kind = rng.random()
        if kind < 0.4:
            yield rng.choice(crafted)
        elif kind < 0.8:
            yield rng.randbytes(rng.choice((1, 2, 4, 8, 9, 16, 17, 64, 256, 1024, 8192)))
        else:
            base = rng.choice(crafted)
            yield base[: rng.randrange(1, len(base) + 1)]  # cut short


def hammer(port: int, seed: int, rounds: int, errors: list[str]) -> None:
    rng = random.Random(seed)
    gen = payloads(rng)
    for _ in range(rounds):
        data = next(gen)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
                s.settimeout(0.05)
                s.sendall(data)
                if rng.random() < 0.5:
                    s.shutdown(socket.SHUT_WR)
                try:
                    s.recv(4096)
                except (TimeoutError, OSError):
                    pass
        except ConnectionRefusedError as e:  # nothing listens any more: the server died
            errors.append(f"port {port}: {e}")
            return
        except OSError:
            pass  # reset by the server: an answer too


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_no_bytes_on_the_store_control_or_metrics_port_stop_the_server(procs, port):
    control, metrics = free_port(), free_port()
    server = procs.server(port, "--metrics-port", str(metrics), control_port=control)
    trainers = [procs.trainer(port, r, "--num-trainers", "2", "--epochs", "1000", "--max-steps", str(STEPS),
                              env=slow_steps(STEP_DELAY)) for r in (0, 1)]
    for t in trainers:
        t.wait_for(r"joined psserver", timeout=90)
    errors: list[str] = []
    threads = [threading.Thread(target=hammer, args=(p, i, ROUNDS, errors), daemon=True)
               for i, p in enumerate((port, control, metrics))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    assert not any(th.is_alive() for th in threads)
    assert not errors, errors
    assert server.running(), server.tail()
    # Every port still does its job: the control plane answers, the metrics are served.
    with ControlClient(f"127.0.0.1:{control}", timeout=10) as client:
        assert {t.rank for t in client.list_trainers()} == {0, 1}
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as r:
        assert b"psserver_steps_total" in r.read()
    for t in trainers:
        assert t.wait(300) == 0, t.tail()
    assert procs.stop(server) == 0, server.tail()
    # Async: one optimizer step per trainer step, each applied once through the fuzz.
    assert f"psserver stopped at global step {2 * STEPS}" in server.output(), server.tail()
