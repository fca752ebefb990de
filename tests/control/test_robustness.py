"""Bad input on the wire: unknown fields, garbage bytes, vanishing clients, non-gRPC traffic.

Each case checks the status code the caller gets and that the server still answers after.
"""

from __future__ import annotations

import socket
import time

import grpc
import pytest

from psserver.control import SERVICE_NAME
from psserver.control.client import ControlClient
from psserver.control.v1 import control_pb2 as pb

from .fakes import TOKEN, serve

pytestmark = pytest.mark.timeout(60)

# Field 99 (varint 1), field 100 (length-delimited "hello"): unknown to every request message.
UNKNOWN_FIELDS = bytes([0x98, 0x06, 0x01, 0xA2, 0x06, 0x05]) + b"hello"


def _raw(channel: grpc.Channel, method: str, streaming: bool = False):
    make = channel.unary_stream if streaming else channel.unary_unary
    return make(f"/{SERVICE_NAME}/{method}", request_serializer=None, response_deserializer=None)


def _still_serving(address: str, token: str | None = None) -> None:
    with ControlClient(address, token=token) as client:
        assert client.get_status().state == pb.SERVER_STATE_SERVING
        assert client.health() == "SERVING"


def test_unknown_fields_are_ignored(server):
    with grpc.insecure_channel(server.address) as channel:
        status = pb.ServerStatus.FromString(_raw(channel, "GetStatus")(UNKNOWN_FIELDS, timeout=5))
        assert status.model == "mlp"
        trainers = pb.ListTrainersResponse.FromString(_raw(channel, "ListTrainers")(UNKNOWN_FIELDS, timeout=5))
        assert len(trainers.trainers) == 2
        # interval_seconds (field 1, double) = 0.2, then unknown fields.
        request = pb.WatchStatusRequest(interval_seconds=0.2).SerializeToString() + UNKNOWN_FIELDS
        stream = _raw(channel, "WatchStatus", streaming=True)(request, timeout=10)
        assert pb.ServerStatus.FromString(next(stream)).model == "mlp"
        stream.cancel()
    _still_serving(server.address)


@pytest.mark.parametrize(
    "payload",
    [
        b"\xff\xff\xff\xff",  # field number 0 / truncated varint
        bytes([0x0A, 0x64]) + b"short",  # field 1 as a 100-byte string with 5 bytes
        bytes([0x09, 0x00]),  # field 1 as a double with 1 byte of 8
    ],
    ids=["garbage", "truncated-string", "truncated-double"],
)
def test_undecodable_requests_get_a_status_not_a_crash(server, payload):
    with grpc.insecure_channel(server.address) as channel:
        for method, streaming in (("GetStatus", False), ("WatchStatus", True)):
            with pytest.raises(grpc.RpcError) as e:
                call = _raw(channel, method, streaming)(payload, timeout=5)
                if streaming:
                    next(call)
            # gRPC Python reports a request it cannot deserialize as INTERNAL.
            assert e.value.code() == grpc.StatusCode.INTERNAL, (method, e.value)
    _still_serving(server.address)


def test_undecodable_request_without_the_token_is_unauthenticated(auth_server):
    # Authentication comes first: the bytes of an anonymous caller are never parsed.
    with grpc.insecure_channel(auth_server.address) as channel:
        with pytest.raises(grpc.RpcError) as e:
            _raw(channel, "GetStatus")(b"\xff\xff\xff\xff", timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    _still_serving(auth_server.address, TOKEN)


def test_unknown_method_is_unimplemented(server):
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as e:
            channel.unary_unary(f"/{SERVICE_NAME}/Explode")(b"", timeout=5)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
    _still_serving(server.address)


def test_a_client_that_vanishes_mid_stream(server):
    channel = grpc.insecure_channel(server.address)
    stream = _raw(channel, "WatchStatus", streaming=True)(
        pb.WatchStatusRequest(interval_seconds=0.1).SerializeToString()
    )
    next(stream)
    next(stream)
    assert server.service.watchers == 1
    channel.close()  # drops the connection with the stream open
    deadline = time.monotonic() + 5
    while server.service.watchers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.service.watchers == 0, "the server kept streaming to a client that left"
    _still_serving(server.address)


_KILLED_CLIENT = """
import sys, grpc
from psserver.control.v1 import control_pb2 as pb, control_pb2_grpc as pb_grpc
stub = pb_grpc.ControlServiceStub(grpc.insecure_channel(sys.argv[1]))
for status in stub.WatchStatus(pb.WatchStatusRequest(interval_seconds=0.1)):
    print("got", status.global_step, flush=True)
"""


def test_a_client_process_killed_mid_stream(server):
    # SIGKILL: no RST_STREAM, no GOAWAY; the kernel closes the socket.
    import os
    import subprocess
    import sys
    from pathlib import Path

    import psserver

    root = str(Path(psserver.__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_CLIENT, server.address], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        env=env, text=True,
    )
    try:
        assert proc.stdout.readline().startswith("got"), "the client process did not get a status"
        assert server.service.watchers == 1
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()
    deadline = time.monotonic() + 5
    while server.service.watchers and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.service.watchers == 0
    _still_serving(server.address)


@pytest.mark.parametrize(
    "garbage",
    [
        b"GET / HTTP/1.1\r\nHost: localhost\r\nUser-Agent: curl/8\r\n\r\n",
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x12\x07\x00" + b"\xde\xad" * 40,  # bad frames
        bytes(range(256)) * 4,
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03",  # the start of a TLS ClientHello
    ],
    ids=["http1", "bad-http2-frames", "binary", "tls-hello"],
)
def test_non_grpc_traffic_on_the_port(server, garbage):
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(garbage)
        sock.settimeout(5)
        received = b""
        try:
            while len(received) < 65536:
                chunk = sock.recv(4096)
                if not chunk:
                    break  # the server closed the connection: fine
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    # Whatever it answered (an HTTP/2 GOAWAY, nothing, a reset), it still serves gRPC.
    _still_serving(server.address)


def test_half_open_connections_do_not_block_others(server):
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(20)]
    try:
        _still_serving(server.address)
    finally:
        for s in socks:
            s.close()
    _still_serving(server.address)


def test_stop_with_a_stream_open_is_prompt(target):
    control = serve(target)
    channel = grpc.insecure_channel(control.address)
    request = pb.WatchStatusRequest(interval_seconds=60).SerializeToString()
    stream = _raw(channel, "WatchStatus", streaming=True)(request)
    next(stream)
    t0 = time.monotonic()
    control.stop()
    assert time.monotonic() - t0 < 2.0  # the 60 s wait was cut short, not waited out
    assert list(stream) == []
    channel.close()
