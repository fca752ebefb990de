"""Two tests at a time (pytest-xdist), and the tests that need the machine to themselves.

The suite's tests start real processes (servers, trainers, each importing torch) and wait on them:
for a heartbeat to be missed, a server to come back, a rate-limited link. Two xdist workers
(``-n auto``, at most 2: the suite is sized for the 2-core CI machine, which one worker alone
keeps 97 % busy) run two tests at a time. A test whose assertion is a time or a
rate measured on this machine (a restart pause, a bandwidth ratio, an alert's firing window)
carries ``@pytest.mark.alone``: it waits until the other worker is between tests and keeps it
there until it is done.

That is a readers-writer lock over the run, on files (``fcntl.flock``): a test takes the shared
side, an ``alone`` test the exclusive one. A turnstile taken first, and held by an ``alone`` test
while it waits, keeps the other worker from starving it by taking the shared side again and again.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCKS_ENV = "PSSERVER_TEST_LOCKS"
"""The directory of this run's lock files, made by the controller and inherited by its workers."""
MAX_WORKERS = 2


def auto_workers() -> int:
    """Workers for ``-n auto``: one per CPU, at most ``MAX_WORKERS``."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


class MachineShare:
    """This worker's side of the run's readers-writer lock (one per worker process)."""

    def __init__(self, directory: Path) -> None:
        self._turnstile = open(directory / "turnstile", "a")  # held for the worker's life
        self._share = open(directory / "share", "a")

    @contextmanager
    def held(self, alone: bool) -> Iterator[None]:
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._share, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        except BaseException:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
            raise
        if not alone:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._share, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(self._turnstile, fcntl.LOCK_UN)

    def close(self) -> None:
        self._turnstile.close()
        self._share.close()
