"""``psserver.v1.WeightsService``: whole versions of the model for readers that never train.

A read streams one version: its header (the step, each tensor's key, dtype and shape, the
CRC-32 of all the bytes), then the bytes in chunks well under gRPC's 4 MiB message limit; or,
to a reader on the server's host and user (``ReadRequest.host``), the name of a file in shared
memory that holds them. The version is whatever the server's :class:`WeightsSource` gives
(``psserver.server.versions``: a copy taken at one global step), so a reader never holds
tensors of two steps; the bytes are encoded once per version and dtype, however many read them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

import grpc

from psserver.config.control import READ_DTYPES
from psserver.control.v1 import control_pb2 as pb
from psserver.control.v1 import control_pb2_grpc as pb_grpc
from psserver.errors import NoVersion

log = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
DEFAULT_TIMEOUT_S = 30.0
MAX_TIMEOUT_S = 3600.0
MAX_NAME = 100
MAX_HOST = 200
MAX_HISTORY = 64
STALL_S = 60.0
"""A read whose sends make no progress for this long is cancelled: a reader that stopped reading
(its flow-control window full) would hold a read's slot, a worker and its version for ever."""


class StallGuard:
    """Cancels the calls it watches once none of their messages went out for ``STALL_S``."""

    def __init__(self) -> None:
        self._due: dict[int, tuple[float, grpc.ServicerContext]] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, key: int, context: grpc.ServicerContext) -> None:
        with self._lock:
            self._due[key] = (time.monotonic() + STALL_S, context)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="psserver-read-stalls", daemon=True)
                self._thread.start()

    def progress(self, key: int) -> None:
        with self._lock:
            if key in self._due:
                self._due[key] = (time.monotonic() + STALL_S, self._due[key][1])

    def done(self, key: int) -> None:
        with self._lock:
            self._due.pop(key, None)

    def close(self) -> None:
        self._closed.set()

    def _run(self) -> None:
        while not self._closed.wait(min(1.0, STALL_S / 4)):
            now = time.monotonic()
            with self._lock:
                if not self._due:  # no read in flight: the next one starts the thread again
                    self._thread = None
                    return
                stalled = [(k, c) for k, (due, c) in self._due.items() if due <= now]
                for key, _ in stalled:
                    del self._due[key]
            for _, context in stalled:
                log.warning("a read of the weights by %s sent nothing for %gs: cancelled", context.peer(), STALL_S)
                context.cancel()


class WeightsSource(Protocol):
    """What the service reads from (``psserver.server.versions.Versions``)."""

    def read(self, newer_than: int | None, timeout: float, history: str = "") -> Any:
        """The newest version (past ``newer_than``, waited for up to ``timeout`` s; any, at once,
        when ``newer_than`` is a step of another ``history`` than the source's), or None;
        ``NoVersion`` when none can be read."""

    def read_done(self, name: str, peer: str, version: Any, sharing: int = 1, nbytes: int = 0) -> float:
        """A reader has all of ``version`` (``nbytes`` sent, for ``sharing`` readers of its host):
        how old it was."""

    def model_name(self) -> str:
        """The model's name, for the header."""

    # Optional: ``local_path(version, dtype, reader_host) -> str | None``, the file of the version
    # for a reader on this host and user (``psserver.server.versions.Versions``); without it,
    # every reader is sent the bytes (a relay).

    def rows(self, table: str, ids: Any) -> tuple[int, Any]:
        """The global step and ``table``'s rows of ``ids`` (an int64 tensor) as held now;
        ``ValueError`` for bad ids or table, ``NoVersion`` when there are none to read."""

    def rows_since(self, table: str, since: int) -> Any:
        """``table``'s delta since its clock ``since`` (``psserver.server.sparse.table.RowChanges``);
        ``ValueError`` for an unknown table, ``NoVersion`` when there are none to read."""


class WeightsService(pb_grpc.WeightsServiceServicer):
    """At most ``max_reads`` calls at once (a read may wait for a version, a row read copies rows):
    RESOURCE_EXHAUSTED past them, so that readers never take the workers of the status calls; of
    them, at most ``FULL_DELTAS`` deltas of every row of a table (each a copy of the table)."""

    FULL_DELTAS = 2

    def __init__(self, source: WeightsSource, max_reads: int = 32) -> None:
        self._source = source
        self._slots = threading.BoundedSemaphore(max_reads)
        self._full = threading.BoundedSemaphore(self.FULL_DELTAS)
        self.max_reads = max_reads
        self._stalls = StallGuard()
        self._count = threading.Lock()
        self.in_flight = 0
        """Calls holding a slot now."""

    @contextlib.contextmanager
    def _slot(self, context: grpc.ServicerContext) -> Iterator[None]:
        if not self._slots.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many reads in flight ({self.max_reads})")
        with self._count:
            self.in_flight += 1
        try:
            yield
        finally:
            with self._count:
                self.in_flight -= 1
            self._slots.release()

    def close(self) -> None:
        """The server stops: waiting reads end (the source's ``close``)."""
        self._stalls.close()
        close = getattr(self._source, "close", None)
        if close is not None:
            close()

    def Read(self, request: pb.ReadRequest, context: grpc.ServicerContext) -> Iterator[pb.WeightsChunk]:
        with self._slot(context):
            yield from self._read(request, context)

    def _read(self, request: pb.ReadRequest, context: grpc.ServicerContext) -> Iterator[pb.WeightsChunk]:
        timeout = request.timeout_seconds or DEFAULT_TIMEOUT_S
        if not (math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT_S):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"timeout_seconds must be in (0, {MAX_TIMEOUT_S:g}] (0 means {DEFAULT_TIMEOUT_S:g}), "
                          f"got {timeout!r}")
        if request.dtype not in READ_DTYPES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"dtype must be one of {', '.join(d for d in READ_DTYPES if d)} (or empty: as held), "
                          f"got {request.dtype[:40]!r}")
        newer_than = request.newer_than if request.HasField("newer_than") else None
        deadline = context.time_remaining()
        if deadline is not None:
            timeout = min(timeout, max(0.0, deadline))
        try:
            version = self._source.read(newer_than, timeout, request.history[:MAX_HISTORY])
        except NoVersion as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no version to read: {e}")
        if version is None:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"no version past step {newer_than} within {timeout:g}s" if newer_than is not None
                          else "the server is stopping")
        local = getattr(self._source, "local_path", None)
        path = local(version, request.dtype, request.host[:MAX_HOST]) if local is not None and request.host else None
        encoded = version.encoded(request.dtype)
        key = id(context)
        self._stalls.watch(key, context)
        try:
            yield from self._send(request, context, version, encoded, path, key)
        finally:
            self._stalls.done(key)

    def _send(self, request: pb.ReadRequest, context: grpc.ServicerContext, version: Any, encoded: Any,
              path: str | None, key: int) -> Iterator[pb.WeightsChunk]:
        yield pb.WeightsChunk(header=pb.VersionHeader(
            step=version.step, published_at=version.published_at, nbytes=len(encoded.data),
            crc32=0 if path else encoded.crc32, model=self._source.model_name(), server_time=time.time(),
            tensors=[pb.TensorMeta(key=k, dtype=d, shape=list(shape), nbytes=n) for k, d, shape, n in encoded.metas],
            path=path or "", history=version.history))
        if not path:
            data = memoryview(encoded.data)
            for start in range(0, len(data), CHUNK_BYTES):
                yield pb.WeightsChunk(data=bytes(data[start:start + CHUNK_BYTES]))
                self._stalls.progress(key)  # resumed: the last chunk went out
        peer = context.peer()
        name = "".join(c for c in request.reader[:MAX_NAME] if c.isprintable()) or peer
        self._source.read_done(name, peer, version, max(1, min(request.sharing, 1 << 20)),
                               0 if path else len(encoded.data))


    def Rows(self, request: pb.RowsRequest, context: grpc.ServicerContext) -> pb.RowsResponse:
        with self._slot(context):
            return self._rows(request, context)

    def _rows(self, request: pb.RowsRequest, context: grpc.ServicerContext) -> pb.RowsResponse:
        import torch

        if request.dtype not in READ_DTYPES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"dtype must be one of {', '.join(READ_DTYPES[1:])} "
                                                            f"(or empty), got {request.dtype[:40]!r}")
        if len(request.ids) % 8:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"ids must be int64s, 8 bytes each: got {len(request.ids)} "
                                                            "bytes")
        ids = torch.frombuffer(bytearray(request.ids), dtype=torch.int64) if request.ids else \
            torch.zeros(0, dtype=torch.int64)
        try:
            step, rows = self._source.rows(request.table, ids)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NoVersion as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no rows to read: {e}")
        dtype = getattr(torch, request.dtype or "float32")
        rows = rows.to(dtype).contiguous()
        return pb.RowsResponse(step=step, width=rows.shape[1] if rows.dim() == 2 else 0,
                               dtype=str(dtype).removeprefix("torch."),
                               rows=rows.reshape(-1).view(torch.uint8).numpy().tobytes() if rows.numel() else b"")


    def RowsSince(self, request: pb.RowsSinceRequest, context: grpc.ServicerContext) -> Iterator[pb.RowsDelta]:
        with self._slot(context):
            if request.since >= 0:
                yield from self._rows_since(request, context)
                return
            wait = context.time_remaining()
            if not self._full.acquire(timeout=DEFAULT_TIMEOUT_S if wait is None else max(0.0, wait)):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"too many reads of every row at once ({self.FULL_DELTAS}): ask again")
            try:
                yield from self._rows_since(request, context)
            finally:
                self._full.release()

    def _rows_since(self, request: pb.RowsSinceRequest, context: grpc.ServicerContext) -> Iterator[pb.RowsDelta]:
        import torch

        if request.dtype not in READ_DTYPES:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"dtype must be one of {', '.join(READ_DTYPES[1:])} "
                                                            f"(or empty), got {request.dtype[:40]!r}")
        if request.since < -1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"since is a table's clock, or -1: got {request.since}")
        try:
            changes = self._source.rows_since(request.table, request.since)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NoVersion as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"no rows to read: {e}")
        dtype = getattr(torch, request.dtype or "float32")
        rows = changes.rows.to(dtype).contiguous()
        width = int(rows.shape[1]) if rows.dim() == 2 else 0
        ids_per = CHUNK_BYTES // 8
        gone = [_le_bytes(changes.gone[i:i + ids_per]) for i in range(0, changes.gone.numel(), ids_per)] or [b""]
        yield pb.RowsDelta(step=changes.step, full=changes.full, width=width, dtype=str(dtype).removeprefix("torch."),
                           gone=gone[0])
        for chunk in gone[1:]:
            yield pb.RowsDelta(gone=chunk)
        per = max(1, CHUNK_BYTES // (width * dtype.itemsize + 8))
        for start in range(0, changes.ids.numel(), per):
            yield pb.RowsDelta(ids=_le_bytes(changes.ids[start:start + per]), rows=_le_bytes(rows[start:start + per]))


def _le_bytes(t: Any) -> bytes:
    """A tensor's bytes as they lie (little-endian on the machines torch runs on)."""
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def add_to_server(service: WeightsService, server: Any) -> None:
    pb_grpc.add_WeightsServiceServicer_to_server(service, server)
