"""A read has no deadline of its own past its wait for a version: a large version over a slow
link takes what it takes, while a transfer that stalls is given up with a clear error."""

from __future__ import annotations

import threading
import time
import zlib
from concurrent import futures

import grpc
import pytest
import torch

from psserver.control.v1 import control_pb2 as pb
from psserver.control.v1 import control_pb2_grpc as pb_grpc
from psserver.errors import ServerUnavailable
from psserver.reader import reader as reader_module
from psserver.reader.reader import Reader

CHUNKS = 8
CHUNK = 4096


class Trickle(pb_grpc.WeightsServiceServicer):
    """One version of ``CHUNKS`` chunks, ``gap`` s apart; ``stall_after``: chunks sent before it
    sends nothing more (until released at the test's end)."""

    def __init__(self, gap: float, stall_after: int | None = None) -> None:
        self.gap, self.stall_after = gap, stall_after
        self.release = threading.Event()
        self.data = torch.arange(CHUNKS * CHUNK // 4, dtype=torch.float32).numpy().tobytes()

    def Read(self, request, context):
        numel = len(self.data) // 4
        yield pb.WeightsChunk(header=pb.VersionHeader(
            step=7, nbytes=len(self.data), crc32=zlib.crc32(self.data), model="toy", server_time=time.time(),
            history="ab", tensors=[pb.TensorMeta(key="w", dtype="float32", shape=[numel], nbytes=len(self.data))]))
        for i in range(CHUNKS):
            if self.stall_after is not None and i == self.stall_after:
                self.release.wait(30)
                return
            time.sleep(self.gap)
            yield pb.WeightsChunk(data=self.data[i * CHUNK:(i + 1) * CHUNK])


@pytest.fixture
def serve():
    started = []

    def start(servicer: Trickle) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_WeightsServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        started.append((server, servicer))
        return f"127.0.0.1:{port}"

    yield start
    for server, servicer in started:
        servicer.release.set()
        server.stop(grace=None)


def test_a_transfer_longer_than_the_wait_and_the_stall_limit_completes(serve, monkeypatch):
    monkeypatch.setattr(reader_module, "STALL_S", 1.0)
    address = serve(Trickle(gap=0.3))  # 2.4 s in all: past the wait (0.5 s) plus the stall limit (1 s)
    with Reader(address, timeout=0.5) as reader:
        version = reader.latest()
    assert version.step == 7 and version.history == "ab"
    assert torch.equal(version.state["w"], torch.arange(CHUNKS * CHUNK // 4, dtype=torch.float32))


def test_a_transfer_that_stalls_is_given_up_with_a_clear_error(serve, monkeypatch):
    monkeypatch.setattr(reader_module, "STALL_S", 1.0)
    address = serve(Trickle(gap=0.0, stall_after=3))
    started = time.monotonic()
    with Reader(address, timeout=0.5) as reader, pytest.raises(ServerUnavailable, match=r"nothing came for 1s"):
        reader.wait(3)
    assert time.monotonic() - started < 10
