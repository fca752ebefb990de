"""The ``staged`` transport's host side (``psserver.common.transport``): a GPU trainer's
gradient copied into pinned host memory on a side stream, and sent from there.

A bucket sent ahead of the step's call (a ``part``) is filled during backward, inside an
autograd hook: the hook only starts its copy and records an event; one sender thread waits
for the event and starts the RPC, so backward never waits for a copy to land.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any, Protocol

import torch


class Landed(Protocol):
    """What says a copy landed (a ``torch.cuda.Event``)."""

    def synchronize(self) -> None: ...


class AfterCopy:
    """A part's send, made once its copy has landed: :meth:`wait` gives the RPC's result or
    raises its error, as the RPC's own future would."""

    def __init__(self, sender: concurrent.futures.ThreadPoolExecutor, landed: Landed,
                 send: Callable[[], Any]) -> None:
        def after() -> Any:
            landed.synchronize()
            return send()

        self._started = sender.submit(after)

    @staticmethod
    def sender() -> concurrent.futures.ThreadPoolExecutor:
        """One thread: parts go out in the order backward filled them."""
        return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="psserver-parts")

    def wait(self) -> Any:
        return self._started.result().wait()


class PinnedStaging:
    """The ``staged`` transport's host side: one pinned buffer per flat gradient, allocated once
    and reused every step, filled on a side stream. Reuse is safe because a step's buffers are
    sent before the next step's gradient exists (its call returned: the server has them)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.buffers: dict[tuple, torch.Tensor] = {}
        self._sender: concurrent.futures.ThreadPoolExecutor | None = None

    def _buffer(self, key: tuple, flat: torch.Tensor) -> torch.Tensor:
        buf = self.buffers.get(key)
        if buf is None or buf.shape != flat.shape or buf.dtype != flat.dtype:
            buf = self.buffers[key] = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        return buf

    def to_host(self, flats: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
        """``flats`` (on the device) copied into the pinned buffers, ready to send."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for i, server in enumerate(flats):
                for j, flat in enumerate(server):
                    self._buffer((i, j), flat).copy_(flat, non_blocking=True)
                    flat.record_stream(self.stream)
        return [self.collect([((i, j), flat) for j, flat in enumerate(server)]) for i, server in enumerate(flats)]

    def copy_part(self, key: tuple, flat: torch.Tensor, start: int, stop: int) -> None:
        """Start copying ``flat[start:stop]`` (a bucket just filled, on the stream that filled
        it) into its place in ``key``'s pinned buffer; :meth:`collect` waits for it. ``flat``
        lives as long as the trainer (a bucket buffer): no ``record_stream``."""
        buf = self._buffer(key, flat)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            buf[start:stop].copy_(flat[start:stop], non_blocking=True)

    def part(self, key: tuple, values: torch.Tensor) -> torch.Tensor:
        """``values`` (a bucket filled) in ``key``'s pinned buffer of their size, landed."""
        buf, landed = self.start_part(key, values)
        landed.synchronize()
        return buf

    def start_part(self, key: tuple, values: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Start copying ``values`` into ``key``'s pinned buffer of their size: the buffer, and
        the event that says the copy landed. ``values`` is a view of a bucket buffer, which lives
        as long as the trainer and is filled again only after the step's parts were waited for."""
        buf = self._buffer(key, values)
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            buf.copy_(values, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self.stream)
        return buf, landed

    def send_when_landed(self, landed: Landed, send: Callable[[], Any]) -> AfterCopy:
        """``send()`` (an RPC's start, returning its future) run on this staging's sender thread
        once ``landed`` has: the caller (an autograd hook) does not wait for the copy."""
        if self._sender is None:
            self._sender = AfterCopy.sender()
        return AfterCopy(self._sender, landed, send)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.shutdown(wait=True)
            self._sender = None

    def collect(self, parts: list[tuple[tuple, torch.Tensor]]) -> list[torch.Tensor]:
        """The pinned buffers of ``(key, flat)`` parts, once every copy into them has landed (a
        part nothing was copied into, a shard without parameters, gets its empty buffer)."""
        self.stream.synchronize()
        return [self._buffer(key, flat) for key, flat in parts]
