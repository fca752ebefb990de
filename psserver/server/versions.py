"""Versions of the model for readers of the weights (``WeightsService``), while training runs.

A version is the model's ``state_dict`` copied to the CPU under the update lock: the
parameters and buffers of one global step, never a mix of two. It is taken when a reader asks
for one newer than the newest copy and a step has been applied since (at most once per
``publish_interval``), never while no reader asks: training pays one copy of the model per
version, whatever the number of readers, and readers never hold the live state for the length
of a transfer. Each version is encoded once per dtype asked for (the bytes and their CRC-32),
and every reader of it is sent those bytes; a reader on this host, run by this user, is handed
a file of them in shared memory instead (``psserver.server.version_files``).

Readers are kept by name for ``psserver status`` and the metrics: the step each read last and
how old it was when the reader had all of it. Rows of embedding tables are not in versions: a
reader that serves looks them up as they are held (``rows``).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from psserver.common.versions import Encoded, Version, encode
from psserver.errors import NoVersion
from psserver.server.version_files import VersionFiles
from psserver.telemetry import AgeHistogram, ReaderStatus

READERS_KEPT_S = 600.0
"""A reader not seen for this long leaves ``psserver status``."""
MAX_READERS = 1024
"""Readers kept by name: a stranger naming itself anew on every call cannot grow the table."""

__all__ = ["Encoded", "Version", "Versions", "encode"]


class Versions:
    """The newest version and the readers of this server. ``copy`` takes a version: the global
    step and the model's CPU ``state_dict`` at it, under the update lock (``NoVersion`` when
    there is no model to read), and optionally its ``Packed`` bytes; ``applied`` the global
    step applied now."""

    def __init__(self, copy: Callable[[], tuple], applied: Callable[[], int],
                 publish_interval: float = 0.25, model: Callable[[], str] = lambda: "",
                 rows: Callable[[str, torch.Tensor], tuple[int, torch.Tensor]] | None = None,
                 changes: Callable[[str, int], Any] | None = None) -> None:
        self._copy = copy
        self._rows = rows
        self._changes = changes
        self._applied = applied
        self.publish_interval = publish_interval
        self._model = model
        self.ages = AgeHistogram()
        self.copies = 0
        """Versions copied (each one copy of the model under the update lock)."""
        self.bytes_sent = 0
        """Bytes of versions sent to readers."""
        self.lookups = 0
        """Row lookups readers made."""
        self._cond = threading.Condition()
        self._copying = threading.Lock()
        self._latest: Version | None = None
        self._copied_at = 0.0  # time.monotonic() of the newest copy
        self._applied_at: dict[int, float] = {}  # the last few steps' wall-clock times
        self._readers: dict[str, ReaderStatus] = {}
        self._closed = False
        self.files = VersionFiles()
        """Versions as files, for readers on this host and user (``psserver.server.version_files``)."""
        self.history = secrets.token_hex(8)
        """This process's line of versions: a server started again (from shared memory, or from an
        older checkpoint) may serve a step again with other weights, so readers are told that
        its versions are of another history, and take its newest whatever their last step."""

    def on_step(self, step: int, samples: int) -> None:  # noqa: ARG002 - an engine listener
        """A step was applied: waiting readers may take it."""
        with self._cond:
            self._applied_at[step] = time.time()
            if len(self._applied_at) > 64:
                del self._applied_at[min(self._applied_at)]
            self._cond.notify_all()

    def new_history(self) -> None:
        """The model went back to a checkpoint in this process: its steps come again with other
        weights, under another history, and no version of before is served again."""
        with self._cond:  # (not the copying lock: a copy in flight may wait for the caller's locks)
            self.history = secrets.token_hex(8)
            self._latest = None
            self._copied_at = 0.0
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.files.close()

    def local_path(self, version: Version, dtype: str, reader_host: str) -> str | None:
        """The file of ``version`` in ``dtype`` for a reader on ``reader_host`` when that is this
        host and user (none past ``close``); else None: it is sent the bytes."""
        if self._closed:
            return None
        return self.files.path_for(version, dtype, reader_host, self._model())

    def read(self, newer_than: int | None, timeout: float, history: str = "") -> Version | None:
        """The newest version (of a step past ``newer_than``, waiting up to ``timeout`` s for
        one; at once when ``newer_than`` is of another ``history``); None when none came in time
        or the server is stopping."""
        deadline = time.monotonic() + timeout
        floor = -1 if newer_than is None or (history and history != self.history) else newer_than
        while True:
            try:
                version = self._fresh()
            except NoVersion as e:  # no model yet: a reader that waits, waits for it too
                if newer_than is None or not e.later:
                    raise
                with self._cond:
                    self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
                if time.monotonic() >= deadline or self._closed:
                    return None
                continue
            if version.step > floor:
                return version
            with self._cond:  # wait for a step past both
                while not self._closed and self._applied() <= max(floor, version.step):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self._cond.wait(left)
                if self._closed:
                    return None
            wait = self._copied_at + self.publish_interval - time.monotonic()
            if wait > 0:  # at most one copy of the model per interval, however many read
                if time.monotonic() + wait > deadline:
                    return None
                time.sleep(wait)

    def _fresh(self) -> Version:
        """The newest version, copied now when a step was applied since it and the interval
        has passed (the first one at once)."""
        latest = self._latest
        if latest is not None and (self._applied() <= latest.step
                                   or time.monotonic() - self._copied_at < self.publish_interval):
            return latest
        with self._copying:  # one reader copies, the others take its copy
            latest = self._latest
            due = time.monotonic() - self._copied_at >= self.publish_interval
            while latest is None or (due and self._applied() > latest.step):
                history = self.history
                step, state, *packed = self._copy()  # (a packed snapshot: its tensors are views of its bytes)
                with self._cond:
                    if history != self.history:  # gone back to a checkpoint while it copied: copy again
                        latest = None
                        continue
                    published = self._applied_at.get(step, time.time())
                    latest = self._latest = Version(step, published, state, packed[0] if packed else None,
                                                    history=history)
                self._copied_at = time.monotonic()
                self.copies += 1
                break
            return latest

    # ---- who reads ---------------------------------------------------------------------

    def read_done(self, name: str, peer: str, version: Version, sharing: int = 1, nbytes: int = 0) -> float:
        """A reader has all of ``version`` now (``nbytes`` sent, for ``sharing`` readers of its
        host): kept for status; how old it was."""
        now = time.time()
        age = max(0.0, now - version.published_at)
        with self._cond:
            seen = self._readers.get(name)
            if seen is None:
                if len(self._readers) >= MAX_READERS:
                    self._forget(now, keep=MAX_READERS - 1)
                seen = self._readers[name] = ReaderStatus(name, peer)
            seen.peer, seen.step, seen.read_at, seen.age_s, seen.sharing = peer, version.step, now, age, sharing
            seen.reads += 1
            self.ages.observe(age)
            self.bytes_sent += nbytes
        return age

    def model_name(self) -> str:
        return self._model()

    def rows(self, table: str, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The global step and ``table``'s rows of ``ids`` as held now (a serving lookup)."""
        if self._rows is None:
            raise NoVersion("this server serves no embedding rows")
        step, rows = self._rows(table, ids)
        with self._cond:
            self.lookups += 1
        return step, rows

    def rows_since(self, table: str, since: int) -> Any:
        """``table``'s delta for a reader that holds its rows as of the table's clock ``since``
        (``psserver.server.sparse.table.RowChanges``)."""
        if self._changes is None:
            raise NoVersion("this server serves no embedding rows")
        changes = self._changes(table, since)
        with self._cond:
            self.lookups += 1
        return changes

    def age_histogram(self) -> AgeHistogram:
        with self._cond:
            return replace(self.ages, counts=list(self.ages.counts))

    def readers(self) -> list[ReaderStatus]:
        now = time.time()
        with self._cond:
            self._forget(now)
            return sorted((replace(r) for r in self._readers.values()), key=lambda r: r.name)

    def _forget(self, now: float, keep: int | None = None) -> None:
        """(lock held) Readers not seen for ``READERS_KEPT_S``; and the longest unseen past ``keep``."""
        for name in [n for n, r in self._readers.items() if now - r.read_at > READERS_KEPT_S]:
            del self._readers[name]
        if keep is not None and len(self._readers) > keep:
            for r in sorted(self._readers.values(), key=lambda r: r.read_at)[:len(self._readers) - keep]:
                del self._readers[r.name]
