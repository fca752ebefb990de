"""``Reader``: whole versions of a running psserver's model, over its control plane.

Each read is one version: the parameters and buffers of one global step (the server copies
them under its update lock), checked against the CRC-32 its header carries, so a reader never
holds tensors of two steps or a version damaged on the way. Reads go to the control plane's
``WeightsService`` (gRPC), not the training RPC group: a reader is never a member, never in a
sync round, never evicted, and its token (``--read-token-file`` on the server) opens nothing else.

    import psserver
    with psserver.read("10.0.0.5:50051", token_file="read.token", dtype="bfloat16") as reader:
        for version in reader.subscribe():      # each new version it can keep up with
            reader.load_into(policy, version)   # in place, on the policy's device and dtype
            rollout(policy, version.step)
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import torch
from torch import nn

from psserver.common import version_files
from psserver.config.common import read_token_file
from psserver.config.control import READ_DTYPES, READ_TOKEN_ENV
from psserver.control.auth import check_token
from psserver.control.client import default_address, open_channel
from psserver.control.v1 import control_pb2 as pb
from psserver.control.v1 import control_pb2_grpc as pb_grpc
from psserver.errors import ServerUnavailable, UsageError
from psserver.reader.host_copy import HostCopy
from psserver.reader.raw import Raw

log = logging.getLogger(__name__)

FILE_TRIES = 2
"""Reads of one version through the server's file (on its host) before its bytes are asked for."""
MAX_MESSAGE = 16 << 20
"""Largest message taken from the server (its chunks are 1 MiB; a header lists every tensor)."""
STALL_S = 60.0
"""A read given up when nothing came for this long, past its wait for a version: a transfer has
no deadline of its own (a large model over a slow link takes what it takes), a stalled one does."""
HISTORY = re.compile(r"[0-9a-f]{0,32}")


@dataclass
class Version:
    """One version of the model: its global ``step`` and its ``state_dict`` (the model's own keys)."""

    step: int
    state: dict[str, torch.Tensor]
    published_at: float
    """When the server applied ``step`` (Unix seconds, the server's clock)."""
    received_at: float
    """When this reader had all of it (Unix seconds, on the server's clock as the header told it)."""
    model: str
    history: str = ""
    """The server's line of versions: steps only grow within one. A server started again (or
    gone back to an older checkpoint) starts another, and may serve a step again with other
    weights: :meth:`Reader.wait` and :meth:`Reader.subscribe` hand its newest over at once."""

    @property
    def age(self) -> float:
        """How old the version was when this reader had it (seconds): its freshness."""
        return max(0.0, self.received_at - self.published_at)


@dataclass
class RowsRead:
    """Rows of an embedding table as the server held them at global step ``step``."""

    step: int
    values: torch.Tensor
    """``[len(ids), width]``, row i for ``ids[i]``."""


@dataclass(frozen=True)
class RowsDelta:
    """What a reader holding table rows as of the table's clock ``since`` needs to hold them as
    of ``step`` (:meth:`Reader.rows_since`): drop ``gone`` (``full``: drop everything), then set
    the rows of ``ids`` to ``rows``."""

    step: int
    """The table's clock of this delta: ask the next one from it."""
    full: bool
    """Every row is here: whatever the reader held goes first."""
    gone: torch.Tensor
    """Ids whose rows were dropped (evicted, expired): they read the table's default row again."""
    ids: torch.Tensor
    rows: torch.Tensor
    """``[len(ids), width]``, in the reader's dtype on its device."""

    def apply_to(self, held: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """``held`` (id -> row, as an earlier delta left it) brought up to this delta; returned."""
        if self.full:
            held.clear()
        for i in self.gone.tolist():
            held.pop(i, None)
        for i, row in zip(self.ids.tolist(), self.rows, strict=True):
            held[i] = row
        return held


def resolve_read_token(token: str | None = None, token_file: Path | str | None = None) -> str | None:
    """``token``, else the file's, else ``$PSSERVER_READ_TOKEN``, else None (a server without one)."""
    if token is not None:
        return check_token(token, "the reader's token")
    if token_file is not None:
        try:
            return check_token(read_token_file(token_file, "--read-token-file"), f"--read-token-file {token_file}")
        except ValueError as e:
            raise UsageError(str(e)) from None
    return check_token(os.environ.get(READ_TOKEN_ENV) or None, f"${READ_TOKEN_ENV}")


class Reader:
    """A reader of one server's weights. ``dtype``: floating-point tensors cross in it
    (``"bfloat16"`` halves the bytes; None: as the server holds them); ``device``: where the
    versions' tensors are put; ``name``: what ``psserver status`` lists it as; ``share``: the
    readers of this user on this host that share read one copy, which one of them fetches
    (``psserver.reader.host_copy``): the server sends each version to the host once;
    ``server_files``: from a server on this host, run by this user, take its own file of each
    version in shared memory instead of its bytes (no copy; False: the bytes, as from elsewhere)."""

    def __init__(self, address: str | None = None, *, token: str | None = None, token_file: Path | str | None = None,
                 tls_ca: Path | str | bytes | None = None, name: str = "", dtype: str | torch.dtype | None = None,
                 device: str | torch.device = "cpu", timeout: float = 30.0, share: bool = False,
                 server_files: bool = True) -> None:
        self.address = address or default_address()
        self.dtype = _dtype_name(dtype)
        self.device = torch.device(device)
        self.name = name
        self.timeout = timeout
        token = resolve_read_token(token, token_file)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.has_token = bool(token)
        """Whether it reads with a token (a relay serves such weights beyond loopback only with one)."""
        options = [("grpc.max_receive_message_length", MAX_MESSAGE)]
        self._channel = open_channel(self.address, tls_ca, options)
        self._stub = pb_grpc.WeightsServiceStub(self._channel)
        self._host_id = version_files.host_id() if server_files else ""
        """Sent with each read: a server on this host and user answers with its file of the
        version (``psserver.common.version_files``); emptied once such a file proves unusable."""
        self._known: tuple[list, list] | None = None  # the last layout of versions, checked
        self._history = ""  # of the last version read: a step to wait past is one of it
        self._host: HostCopy | None = None
        if share:
            self._host = HostCopy(self.address, self.dtype, self._fetch)

    def close(self) -> None:
        if self._host is not None:
            self._host.close()
            self._host = None
        self._channel.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- reads --------------------------------------------------------------------------

    def latest(self) -> Version:
        """The newest version."""
        version = self._read(None, self.timeout)
        if version is None:  # the host's copy had none in time: its fetcher got none from the server
            raise ServerUnavailable(f"no version of {self.address} came within {self.timeout:g}s to the readers "
                                    "of this host")
        return version

    def wait(self, newer_than: int, timeout: float | None = None) -> Version | None:
        """The newest version of a step past ``newer_than``, waiting up to ``timeout`` s (default:
        the reader's) for one; None when none came. A server that started another history since
        this reader's last version (restarted) hands its newest over at once, whatever its step."""
        return self._read(int(newer_than), self.timeout if timeout is None else timeout)

    def subscribe(self, timeout: float | None = None) -> Iterator[Version]:
        """Each new version, the newest one each time: a reader slower than training skips the
        versions it could not keep up with. Ends when none came for ``timeout`` s (None: never);
        a server out of reach after the first version (restarting) is asked again every second."""
        version = self.latest()
        yield version
        since, down = time.monotonic(), False
        while True:
            wait = self.timeout if timeout is None else max(0.0, timeout - (time.monotonic() - since))
            try:
                newer = self.wait(version.step, wait)
            except ServerUnavailable as e:
                if not down:
                    log.warning("%s; asking again every second", e)
                    down = True
                newer = None
                time.sleep(1.0)
            else:
                if down:
                    log.info("the weights of %s answer again", self.address)
                    down = False
            if newer is None:
                if timeout is not None and time.monotonic() - since >= timeout:
                    return
                continue
            version, since = newer, time.monotonic()
            yield version

    def load_into(self, model: nn.Module, version: Version | None = None, *, strict: bool = True) -> Version:
        """Copy ``version`` (default: the newest) into ``model`` in place, each tensor cast to
        the model's device and dtype; the version. ``strict``: the keys must be the model's own."""
        version = self.latest() if version is None else version
        own = model.state_dict(keep_vars=True)
        missing = [k for k in own if k not in version.state]
        extra = [k for k in version.state if k not in own]
        if strict and (missing or extra):
            what = "; ".join(x for x in (f"missing {', '.join(missing[:3])}" if missing else "",
                                         f"unexpected {', '.join(extra[:3])}" if extra else "") if x)
            raise UsageError(f"version {version.step} of {version.model or 'the model'} does not fit this model: "
                             f"{what}")
        with torch.no_grad():
            for key, value in version.state.items():
                target = own.get(key)
                if target is None:
                    continue
                if target.shape != value.shape:
                    raise UsageError(f"{key}: the server's is {tuple(value.shape)}, this model's {tuple(target.shape)}")
                target.copy_(value, non_blocking=True)
        return version

    def rows(self, table: str, ids: torch.Tensor | Sequence[int]) -> RowsRead:
        """The rows of ``ids`` in embedding table ``table`` as the server holds them now (one per
        id, repeats allowed), in the reader's dtype (float32 by default) on its device; an id
        without a row reads the table's default row, as in training. For serving: nothing is
        created on the server, nothing counts as a touch."""
        ids = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        unique, inverse = torch.unique(ids, return_inverse=True)
        request = pb.RowsRequest(table=table, ids=unique.numpy().tobytes(), dtype=self.dtype)
        try:
            answer = self._stub.Rows(request, timeout=self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._error(e) from None
        dtype = getattr(torch, answer.dtype, None)
        if not isinstance(dtype, torch.dtype) or len(answer.rows) != unique.numel() * answer.width * dtype.itemsize:
            raise UsageError(f"{self.address} answered {len(answer.rows)} bytes of {answer.dtype} for "
                             f"{unique.numel()} rows of {answer.width}")
        values = torch.frombuffer(bytearray(answer.rows), dtype=dtype) if answer.rows else torch.zeros(0, dtype=dtype)
        return RowsRead(int(answer.step), values.reshape(unique.numel(), answer.width)[inverse].to(self.device))

    def rows_since(self, table: str, since: int = -1) -> RowsDelta:
        """What changed in embedding table ``table`` since its clock ``since`` (a delta's
        ``step``; -1: every row): the ids dropped and the rows written since, for a reader that
        keeps its own copy of the rows fresh without reading them all again."""
        if isinstance(since, bool) or not isinstance(since, int) or since < -1:
            raise UsageError(f"rows_since: since is a table's clock (a delta's step) or -1, got {since!r}")
        request = pb.RowsSinceRequest(table=table, since=since, dtype=self.dtype, reader=self.name)
        try:
            messages = list(self._stub.RowsSince(request, timeout=self.timeout, metadata=self._metadata))
        except grpc.RpcError as e:
            raise self._error(e) from None
        if not messages:
            raise UsageError(f"{self.address} answered no delta of table {table!r}")
        first = messages[0]
        dtype = getattr(torch, first.dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise UsageError(f"{self.address} sent rows of dtype {first.dtype!r}")
        gone = _int64s(b"".join(m.gone for m in messages), self.address)
        ids = _int64s(b"".join(m.ids for m in messages), self.address)
        data = b"".join(m.rows for m in messages)
        if len(data) != ids.numel() * first.width * dtype.itemsize:
            raise UsageError(f"{self.address} sent {len(data)} bytes of rows for {ids.numel()} ids of {first.width}")
        rows = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.zeros(0, dtype=dtype)
        return RowsDelta(int(first.step), bool(first.full), gone, ids,
                         rows.reshape(ids.numel(), first.width).to(self.device))

    # ---- the wire -----------------------------------------------------------------------

    def _error(self, e: grpc.RpcError) -> Exception:
        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.UNAVAILABLE:
            return ServerUnavailable(f"cannot reach the weights of {self.address}: {details}")
        return UsageError(f"reading the weights of {self.address}: {code.name}: {details}")

    def _read(self, newer_than: int | None, timeout: float) -> Version | None:
        history = self._history if newer_than is not None else ""
        raw = self._fetch(newer_than, timeout, history) if self._host is None else \
            self._host.read(newer_than, timeout, history)
        if raw is None:
            return None
        if raw.history != self._history and self._history:
            log.info("the versions of %s are of another history from step %d (the server started again): "
                     "steps may come again with other weights", self.address, raw.step)
        self._history = raw.history
        return self._version(raw)

    def _fetch(self, newer_than: int | None, timeout: float, history: str = "") -> Raw | None:
        """A version from the server (None: none past ``newer_than`` of ``history`` within
        ``timeout`` s). No deadline covers the transfer: the server ends its own wait, and a
        read that receives nothing for ``STALL_S`` is given up."""
        sharing = self._host.sharing() if self._host is not None else 1
        request = pb.ReadRequest(timeout_seconds=max(timeout, 1e-3), dtype=self.dtype, reader=self.name,
                                 sharing=sharing, host=self._host_id, history=history)
        if newer_than is not None:
            request.newer_than = newer_than
        for attempt in range(FILE_TRIES + 1):
            call = self._stub.Read(request, metadata=self._metadata)
            watchdog = _Watchdog(call, first=timeout + STALL_S, stall=STALL_S)
            try:
                raw = self._assemble(call, watchdog.progress)
            except grpc.RpcError as e:
                if watchdog.fired:
                    raise ServerUnavailable(f"reading the weights of {self.address}: nothing came for "
                                            f"{watchdog.waited:g}s") from None
                if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and newer_than is not None:
                    return None  # the server's answer: no version past newer_than in time
                raise self._error(e) from None
            finally:
                watchdog.stop()
            if raw is not None:
                return raw
            # The server's file went, or was written again, before this reader opened it: ask
            # again (the bytes at the last try, or once its files proved out of reach).
            request.host = self._host_id if attempt + 1 < FILE_TRIES else ""
        raise UsageError(f"{self.address} named files of versions this reader could not open")

    def _assemble(self, chunks: Iterator[pb.WeightsChunk], progress: Callable[[], None] = lambda: None) -> Raw | None:
        """The version ``chunks`` carry (None: the server named its file, gone before it was opened)."""
        header: pb.VersionHeader | None = None
        buf = bytearray()
        offset = 0
        for chunk in chunks:
            progress()
            if chunk.HasField("header"):
                if header is not None:
                    raise UsageError(f"{self.address} sent a second header in one version")
                header = chunk.header
                if not HISTORY.fullmatch(header.history):
                    raise UsageError(f"{self.address} named a history that is not one: {header.history[:40]!r}")
                buf = bytearray(0 if header.path else header.nbytes)
                clock = header.server_time - time.time()  # the server's clock minus this one's
                continue
            if header is None:
                raise UsageError(f"{self.address} sent weights before their header")
            data = chunk.data
            if offset + len(data) > len(buf):
                raise UsageError(f"{self.address} sent more bytes than its header said ({header.nbytes})")
            buf[offset:offset + len(data)] = data
            offset += len(data)
        if header is not None and header.path:
            return self._server_file(header)
        if header is None or offset != len(buf):
            raise UsageError(f"{self.address} ended a version half sent ({offset} of "
                             f"{header.nbytes if header else '?'} bytes)")
        if zlib.crc32(buf) != header.crc32:
            raise UsageError(f"version {header.step} from {self.address} does not match its checksum")
        metas = [(m.key, m.dtype, tuple(int(d) for d in m.shape), int(m.nbytes)) for m in header.tensors]
        return Raw(header.step, header.published_at, header.model, header.crc32, metas, buf, clock,
                   history=header.history)

    def _server_file(self, header: pb.VersionHeader) -> Raw | None:
        """The version in the file the server named (it is on this host, run by this user),
        mapped: checked as the host's copy is (this user's alone, under this user's directory of
        version files, whole, of the step the header says). A file that is not there, in a
        directory that is not, tells that the server's shared memory is not this reader's (a
        container of its own): this reader asks for the bytes from then on."""
        path = Path(header.path)
        what = f"the version file {self.address} named"
        if path.parent.parent != version_files.root() or path.name in ("", ".", ".."):
            raise UsageError(f"{what} is not in this user's directory of version files: {path}")
        try:
            fd = version_files.private_dir(path.parent, what, create=False)
        except FileNotFoundError:
            log.info("the server at %s is on this host, but its version files are not: reading its bytes",
                     self.address)
            self._host_id = ""
            return None
        try:
            found = version_files.load(fd, path.name, path, what)
        finally:
            os.close(fd)
        if found is None:
            return None
        raw = Raw.of_file(*found, path=str(path))
        # Written again since it was named: ask again.
        return raw if (raw.step, raw.history) == (header.step, header.history) else None

    def _version(self, raw: Raw) -> Version:
        """The tensors of ``raw``, checked against what its header says of them, on ``device``."""
        layout = self._layout(raw.metas)
        end = layout[-1][3] + layout[-1][4] if layout else 0
        if end > len(raw.data):
            raise UsageError(f"{self.address} sent {len(raw.data)} bytes for tensors of {end}")
        cpu = self.device.type == "cpu"
        state: dict[str, torch.Tensor] = {}
        for key, dtype, shape, at, nbytes in layout:
            t = torch.frombuffer(raw.data, dtype=dtype, count=nbytes // dtype.itemsize, offset=at).view(shape) \
                if nbytes else torch.empty(shape, dtype=dtype)
            state[key] = t if cpu else t.to(self.device)
        return Version(raw.step, state, raw.published_at, time.time() + raw.clock, raw.model, raw.history)

    def _layout(self, metas: list) -> list[tuple[str, torch.dtype, tuple[int, ...], int, int]]:
        """Each tensor's key, dtype, shape, offset and bytes, checked once per layout (a version
        of a model has the one of the last)."""
        if self._known is not None and self._known[0] == metas:
            return self._known[1]
        layout, at = [], 0
        for key, name, shape, nbytes in metas:
            dtype = getattr(torch, name, None)
            if not isinstance(dtype, torch.dtype) or any(d < 0 for d in shape):
                raise UsageError(f"{self.address} described {key!r} as {name} {shape}")
            numel = 1
            for d in shape:
                numel *= d
            if numel * dtype.itemsize != nbytes:
                raise UsageError(f"{self.address} gave {key!r} {nbytes} bytes for {name} {shape}")
            layout.append((key, dtype, tuple(shape), at, nbytes))
            at += nbytes
        self._known = (metas, layout)
        return layout


class _Watchdog:
    """Cancels a streaming call that receives nothing for ``stall`` s (its first message:
    ``first`` s, the server's wait for a version included)."""

    def __init__(self, call: Any, first: float, stall: float) -> None:
        self._call, self.stall = call, stall
        self.waited = first
        self._due = time.monotonic() + first
        self._cond = threading.Condition()
        self._done = False
        self.fired = False
        self._thread = threading.Thread(target=self._run, name="psserver-read-watchdog", daemon=True)
        self._thread.start()

    def progress(self) -> None:
        self._due = time.monotonic() + self.stall
        self.waited = self.stall

    def stop(self) -> None:
        with self._cond:
            self._done = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._done:
                left = self._due - time.monotonic()
                if left <= 0:
                    self.fired = True
                    self._call.cancel()
                    return
                self._cond.wait(left)


def _int64s(data: bytes, address: str) -> torch.Tensor:
    if len(data) % 8:
        raise UsageError(f"{address} sent ids that are not int64s ({len(data)} bytes)")
    return torch.frombuffer(bytearray(data), dtype=torch.int64) if data else torch.zeros(0, dtype=torch.int64)


def _dtype_name(dtype: str | torch.dtype | None) -> str:
    name = "" if dtype is None else str(dtype).removeprefix("torch.")
    if name not in READ_DTYPES:
        raise UsageError(f"dtype {dtype!r}: one of {', '.join(d for d in READ_DTYPES if d)}, or None (as held)")
    return name


def read(address: str | None = None, **kwargs: object) -> Reader:
    """A :class:`Reader` of the psserver whose control plane is at ``address`` (HOST:PORT;
    default ``$PSSERVER_CONTROL_ADDRESS``, else 127.0.0.1:50051)."""
    return Reader(address, **kwargs)  # type: ignore[arg-type]
