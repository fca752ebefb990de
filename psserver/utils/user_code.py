"""Bounds on the user's code while psserver runs it: an import, a constructor, a first call.

Two things no ``try`` catches are made visible here, for the thread that runs the user's code:

- ``os._exit(n)`` called inside it (at the import of a module, say) would end the process at
  once, with no line and the user's exit code, 0 included. While :func:`running_user_code` is
  active, ``os._exit`` called from that thread of this process raises :class:`ExitCalled`
  instead, which the caller reports in one line. (A module that bound ``os._exit`` before,
  or calls ``posix._exit``, is not caught.)
- A hang (a lock never released, a socket that never answers, ``input()``) would leave the job
  waiting for ever. A watchdog thread ends the process (exit 2, one line naming what hung) once
  the user's thread has been *blocked* past the limit, ``$PSSERVER_USER_CODE_TIMEOUT`` seconds
  (default :data:`DEFAULT_TIMEOUT_S`; 0: none). Time the thread spends computing does not count:
  a slow import or a long preprocessing that uses the CPU is never stopped; a download or a
  compiler run it waits for does count, and a longer limit is the way to allow one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterator

from psserver.errors import UserCodeError

log = logging.getLogger(__name__)

TIMEOUT_ENV = "PSSERVER_USER_CODE_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
"""Blocked seconds before user code counts as hung: far beyond any import that works (those
that compute are not counted at all), short enough that a job stuck at its start is seen."""
BUSY_FRACTION = 0.01
"""A watchdog interval in which the user's thread ran on a CPU for at least this fraction of
it counts as progress, not as blocked time."""


class ExitCalled(BaseException):
    """``os._exit(code)`` called by user code that psserver was running (a ``BaseException``,
    so that the user's own ``except Exception`` does not swallow it)."""

    def __init__(self, code: object) -> None:
        super().__init__(f"called os._exit({code!r})")
        self.code = code


_real_exit = os._exit
_lock = threading.Lock()
_guarded: dict[int, int] = {}
"""Thread ident -> how many :func:`running_user_code` it is inside."""
_owner_pid = 0
_outer_exit = os._exit
"""What ``os._exit`` was before the first :func:`running_user_code` replaced it (put back after)."""


def _exit_in_user_code(code: int) -> None:
    """``os._exit`` while user code runs: :class:`ExitCalled` in the guarded thread of this
    process (not in a child forked meanwhile, not in psserver's other threads)."""
    if os.getpid() == _owner_pid and threading.get_ident() in _guarded:
        raise ExitCalled(code)
    _outer_exit(code)


def timeout_s() -> float | None:
    """``$PSSERVER_USER_CODE_TIMEOUT`` in seconds (None: no limit); ``UserCodeError`` for a value
    that is not a number >= 0."""
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise UserCodeError(f"${TIMEOUT_ENV}={text[:40]!r} is not a number of seconds >= 0 (0: no limit)")
    return value or None


def _stop_process(message: str) -> None:
    """The watchdog's end of a hung process: one line, then exit 2 (the user's thread cannot be
    interrupted where it blocks)."""
    log.error("%s", message)
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    _real_exit(2)


class _Watchdog(threading.Thread):
    """Calls ``expire(message)`` once the watched thread has been blocked for ``limit`` seconds."""

    def __init__(self, what: str, limit: float, expire: Callable[[str], None]) -> None:
        super().__init__(name="psserver-user-code-watchdog", daemon=True)
        self.what, self.limit, self.expire = what, limit, expire
        try:
            self.clock: int | None = time.pthread_getcpuclockid(threading.get_ident())
        except (AttributeError, OSError):  # no per-thread CPU clock here (macOS): wall-clock time counts
            self.clock = None
        self.done = threading.Event()

    def _cpu(self) -> float:
        return 0.0 if self.clock is None else time.clock_gettime(self.clock)

    def run(self) -> None:
        tick = min(1.0, self.limit / 10)
        blocked = 0.0
        cpu = self._cpu()
        while not self.done.wait(tick):
            try:
                now_cpu = self._cpu()
            except OSError:  # the thread is gone
                return
            blocked = 0.0 if now_cpu - cpu >= BUSY_FRACTION * tick else blocked + tick
            cpu = now_cpu
            if blocked >= self.limit:
                self.expire(f"{self.what} has been blocked for over {self.limit:g} s: stopped (${TIMEOUT_ENV} "
                            f"seconds, default {DEFAULT_TIMEOUT_S:g}; raise it for code that waits that long, "
                            "0 for no limit)")
                return


@contextlib.contextmanager
def running_user_code(what: str, limit: float | None,
                      expire: Callable[[str], None] | None = None) -> Iterator[None]:
    """Run the block (the user's code, which ``what`` names: ``importing module 'mypkg.models'``)
    with ``os._exit`` raising :class:`ExitCalled` and a watchdog over hangs. ``limit``: seconds
    of blocked time (None: none; :func:`timeout_s` reads the user's, before the user's code runs
    so that a bad value is not taken for the code's error); ``expire``: what the watchdog does
    (by default: one line, exit 2)."""
    global _owner_pid, _outer_exit
    ident = threading.get_ident()
    with _lock:
        if not _guarded:
            _owner_pid = os.getpid()
            _outer_exit = os._exit
            os._exit = _exit_in_user_code
        _guarded[ident] = _guarded.get(ident, 0) + 1
    watchdog = None
    if limit is not None:
        watchdog = _Watchdog(what, float(limit), expire or _stop_process)
        watchdog.start()
    try:
        yield
    finally:
        if watchdog is not None:
            watchdog.done.set()
        with _lock:
            _guarded[ident] -= 1
            if not _guarded[ident]:
                del _guarded[ident]
            if not _guarded:
                os._exit = _outer_exit


class FirstCallBounded:
    """``fn``, whose first call runs under :func:`running_user_code` (a user's loss: the first
    step is where it hangs if it ever does); later calls go straight through."""

    def __init__(self, fn: Callable, what: str, *, on_first: Callable[[], None] | None = None) -> None:
        functools.update_wrapper(self, fn)
        self.fn, self.what, self.on_first = fn, what, on_first
        self._first = True

    def __call__(self, *args, **kwargs):
        if not self._first:
            return self.fn(*args, **kwargs)
        self._first = False
        if self.on_first is not None:
            self.on_first()
        limit = timeout_s()
        try:
            with running_user_code(f"{self.what}: its first call", limit):
                return self.fn(*args, **kwargs)
        except ExitCalled as e:
            raise UserCodeError(f"{self.what} {e} in its first call") from None


def bound_first_call(fn: Callable, what: str) -> Callable:
    """``fn`` with its first call bounded (:class:`FirstCallBounded`). An ``nn.Module`` stays
    itself (its parameters, ``.to()``, ``isinstance``): only its ``forward`` is wrapped, and put
    back at that first call."""
    from torch import nn

    if isinstance(fn, nn.Module):
        module = fn
        object.__setattr__(module, "forward", FirstCallBounded(
            module.forward, what, on_first=lambda: module.__dict__.pop("forward", None)))
        return module
    return FirstCallBounded(fn, what)


__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "ExitCalled", "FirstCallBounded", "bound_first_call",
           "running_user_code", "timeout_s"]
