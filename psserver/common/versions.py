"""A version of the model as readers are sent it: the tensors of one step, encoded once per dtype
(each tensor's bytes in one buffer, and their CRC-32 when first sent), however many read it. The server's versions
(``psserver.server.versions``) and a relay's (``psserver.reader.relay``) are these."""

from __future__ import annotations

import functools
import math
import sys
import threading
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class Encoded:
    """One version's bytes in one dtype: each tensor's ``(key, dtype name, shape, nbytes)``."""

    metas: list[tuple[str, str, tuple[int, ...], int]]
    data: Any
    """Bytes-like (a ``bytearray``, or a packed snapshot's buffer); never written again once made
    (readers of the version share it)."""

    @functools.cached_property
    def crc32(self) -> int:
        """Of ``data``: computed once, when a reader is first sent the bytes (a reader handed the
        server's file on its own host needs none)."""
        return zlib.crc32(self.data)


@dataclass(frozen=True)
class Packed:
    """A snapshot copied straight into one buffer (``pack``): ``state``'s tensors are views of
    ``data``, in order, so the bytes a reader is sent as held need no copy of their own."""

    metas: list[tuple[str, str, tuple[int, ...], int]]
    data: Any
    """A buffer (bytes-like: ``memoryview``, ``zlib.crc32`` and ``len`` take it)."""


@dataclass
class Version:
    step: int
    published_at: float
    """When the server applied ``step`` (Unix seconds; the copy's time when not known)."""
    state: dict[str, torch.Tensor]
    packed: Packed | None = None
    """``state``'s bytes, where the snapshot was packed (its tensors are views of them)."""
    history: str = ""
    """The server's line of versions (``VersionHeader.history``): steps only grow within one."""
    _encoded: dict[str, Encoded] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def encoded(self, dtype: str) -> Encoded:
        """The bytes of every tensor in ``state``'s order, floating ones in ``dtype`` (one of
        ``READ_DTYPES``; ``""``: as held): made once per dtype (readers of one version share them);
        a packed snapshot's own bytes where every floating tensor is held in ``dtype`` already."""
        with self._lock:
            done = self._encoded.get(dtype)
            if done is None:
                if self.packed is not None and all(not t.is_floating_point() or not dtype
                                                   or t.dtype == getattr(torch, dtype) for t in self.state.values()):
                    done = Encoded(self.packed.metas, self.packed.data)
                else:
                    done = encode(self.state, getattr(torch, dtype) if dtype else None)
                self._encoded[dtype] = done
            return done


class BufferPool:
    """Buffers of versions, used again once nothing holds them. glibc maps every buffer over
    32 MiB afresh, so each version of a large model in new memory paid the kernel's page faults
    and zeroing, as much again as the copy itself. A buffer is free when the pool's is the only
    reference left to it: a version's tensors, its bytes being sent and a view of them each hold
    one (CPython counts them; elsewhere the pool only allocates)."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._counted = sys.implementation.name == "cpython" and getattr(sys, "_is_gil_enabled", lambda: True)()
        # What ``sys.getrefcount`` says, in ``_counts``, of a buffer only the pool holds: measured
        # here, not assumed (interpreters differ: 3.14 borrows references that 3.11 counts).
        self._buffers: list[Any] = [torch.empty(1, dtype=torch.uint8).numpy()]  # held by the list alone
        self.free_refs = next(self._counts())[1]
        self._buffers = []
        self.reused = 0

    def _counts(self) -> Iterator[tuple[Any, int]]:
        for buf in self._buffers:
            yield buf, sys.getrefcount(buf)

    def take(self, nbytes: int) -> Any:
        """A buffer of ``nbytes`` (uninitialised: a free one, else a new one)."""
        with self._lock:
            if self._counted:
                for buf, refs in self._counts():
                    if buf.nbytes == nbytes and refs == self.free_refs:
                        self.reused += 1
                        return buf
            buf = torch.empty(nbytes, dtype=torch.uint8).numpy()
            self._buffers.append(buf)
            del self._buffers[:-self.keep]  # the oldest are forgotten: freed when their holders let go
            return buf


POOL = BufferPool()


def packed_views(specs: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[dict[str, torch.Tensor], Packed]:
    """One buffer for tensors of ``specs`` (key, dtype, shape), in order, and a view of it for
    each: filled by the caller (``copy_``), the buffer is their bytes. Allocated without being
    written (no pass over it before the copy): outside the update lock, the copy alone in it;
    a buffer of an earlier version that nothing holds any more where there is one (``POOL``)."""
    metas = [(k, str(d).removeprefix("torch."), tuple(shape), math.prod(shape) * d.itemsize) for k, d, shape in specs]
    data = POOL.take(sum(m[3] for m in metas))
    out, at = {}, 0
    for (key, _, shape, n), (_, dtype, _) in zip(metas, specs, strict=True):
        count = math.prod(shape)
        view = torch.frombuffer(data, dtype=dtype, count=count, offset=at) if n else torch.empty(count, dtype=dtype)
        out[key] = view.view(shape)
        at += n
    return out, Packed(metas, data)


def pack(values: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Packed]:
    """``values`` (on any device) copied once, into one CPU buffer: the copies, views of it, and
    the buffer with each one's ``(key, dtype name, shape, nbytes)``."""
    out, packed = packed_views([(k, t.dtype, tuple(t.shape)) for k, t in values.items()])
    for key, t in values.items():
        out[key].copy_(t.detach())
    return out, packed


def encode(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> Encoded:
    """Every tensor's bytes, in ``state``'s order, copied once into one buffer (by torch, which
    lets go of the GIL the server's RPC threads need), floating ones cast to ``dtype`` first."""
    metas, tensors = [], []
    for key, t in state.items():
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        metas.append((key, str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel() * t.element_size()))
        tensors.append(t)
    data = bytearray(sum(m[3] for m in metas))
    if data:
        out = torch.frombuffer(data, dtype=torch.uint8)
        at = 0
        for t, (_, _, _, n) in zip(tensors, metas, strict=True):
            if n:
                out[at:at + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
                at += n
    return Encoded(metas, data)
