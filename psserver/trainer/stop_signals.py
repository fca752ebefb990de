"""How a trainer stops on SIGTERM and SIGINT: it leaves psserver first.

Kubernetes and Slurm preempt with SIGTERM; a person presses Ctrl-C. Either way the trainer
finishes the step in flight, hands in what it owes, leaves the group and exits with 128 + the
signal's number, so the server neither shows it ACTIVE nor waits for it in a sync round.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any, NoReturn

log = logging.getLogger(__name__)


_DONE = 0
"""Written to the wakeup pipe when the signals are handed back: no signal has number 0."""


class Stopped(BaseException):
    """SIGTERM or SIGINT where the trainer cannot leave (it waits for a server, or lost it): it
    exits at once with 128 + the signal's number. A ``BaseException``, as ``KeyboardInterrupt``:
    no ``except Exception`` on its way catches it."""

    def __init__(self, signum: int, why: str) -> None:
        super().__init__(signum, why)
        self.signum = signum
        self.why = why

    @property
    def code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """SIGTERM (what Kubernetes and Slurm send to preempt) and SIGINT ask the trainer to leave.

    The handler records the signal and the training loop leaves at the next step boundary: the
    step in flight finishes, what the protocol owes is handed in, the trainer leaves and exits
    with 128 + the signal's number. Raising inside a step or a join instead could leave a
    gradient half-sent or the RPC group's membership token held; only where the trainer waits
    for a server (:meth:`interruptible`) does the handler raise :class:`Stopped`.

    A step blocked inside RPC never returns to the interpreter to see the signal, so a watchdog
    thread reads the signals from a wakeup file descriptor: a second signal, or a leave still
    unfinished ``GRACE_S`` after the first, ends the process at once, without leaving (the
    server then evicts it after its ``--trainer-timeout``).
    """

    GRACE_S = 20.0
    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._interruptible = 0
        self._previous: dict[int, Any] = {}
        self._wakeup: tuple[int, int] | None = None
        self._old_wakeup_fd = -1
        self._watchdog: threading.Thread | None = None

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may handle signals: leave them to the program
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._wakeup = (r, w)
        self._old_wakeup_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._watchdog = threading.Thread(target=self._watch, args=(r,), name="psserver-stop", daemon=True)
        self._watchdog.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
        if self._wakeup is not None:
            signal.set_wakeup_fd(self._old_wakeup_fd)
            r, w = self._wakeup
            self._wakeup = None
            # A byte that is no signal's number tells the watchdog to return: the end of the
            # pipe alone may never come (DataLoader workers forked meanwhile hold its write end).
            with contextlib.suppress(OSError):
                os.write(w, bytes([_DONE]))
            os.close(w)
            if self._watchdog is not None:
                self._watchdog.join(1.0)
            os.close(r)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signum is None:
            self.signum = signum
        if self._interruptible:
            raise Stopped(self.signum, "while waiting for the server")

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A wait for the server that a signal ends at once (:class:`Stopped`)."""
        self.check("while waiting for the server")
        self._interruptible += 1
        try:
            yield
        finally:
            self._interruptible -= 1

    def check(self, why: str) -> None:
        """:class:`Stopped` if a signal arrived."""
        if self.signum is not None:
            raise Stopped(self.signum, why)

    def _watch(self, fd: int) -> None:
        first: int | None = None
        deadline = math.inf
        while True:
            wait = None if first is None else max(0.0, deadline - time.monotonic())
            try:
                ready, _, _ = select.select([fd], [], [], wait)
                if not ready:
                    self._force(first, f"still not gone {self.GRACE_S:g}s after {signal.Signals(first).name}")
                data = os.read(fd, 64)
            except OSError:
                return  # closed under it: the trainer is done
            if not data or _DONE in data:
                return  # the trainer is done
            for signum in data:
                if signum not in self.SIGNALS:
                    continue
                if first is not None:
                    self._force(first, f"{signal.Signals(signum).name} again")
                first, deadline = signum, time.monotonic() + self.GRACE_S

    @staticmethod
    def _force(signum: int | None, why: str) -> NoReturn:
        log.error("%s: exiting without leaving psserver (the server evicts this trainer after its "
                  "--trainer-timeout)", why)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(128 + (signum or signal.SIGTERM))
