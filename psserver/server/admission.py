"""The admission desk: answers joins announced in the store, keeps the server's keys as it wrote them.

A trainer announces a join through the store (``rendezvous.request_admission``); the desk
answers each one with what the server decided (``Membership.admit``) and, when admitted, the
RPC id and incarnation the trainer joins with. Both come from the server's memory, never from
a counter in the store, so a stranger's write to a store key cannot lock a rank out or refuse
every later join. The desk also puts back any key the server published (its state, the
public hello) that someone else changed, and reads nothing it did not bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from psserver.common.rendezvous import (
    ADMITTED,
    KEY_ADMIT_ANSWER,
    KEY_ADMIT_REQUEST,
    KEY_ADMIT_SEQ,
    MAX_RPC_ID,
    SERVER_REQUEST_PREFIX,
)

log = logging.getLogger(__name__)

POLL_S = 0.05
"""How often the desk looks for joins announced in the store (a few local store operations)."""
UNWRITTEN_S = 5.0
"""A join announced but never written (its trainer died in between) is skipped after this long."""
MAX_BACKLOG = 256
"""Announced joins the desk looks at, at most: a counter that jumps further was written by
someone else, and the desk skips to its last ``MAX_BACKLOG`` numbers instead of stalling."""
MAX_REQUEST_BYTES = 32
"""A join request is a rank: anything longer is answered as malformed, unread."""


class PublishedKeys:
    """Store keys the server writes and others only read: put back if anyone changes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._keys: dict[tuple[int, str], tuple[object, bytes]] = {}
        self.repaired = 0

    def set(self, store, key: str, value: str) -> None:
        with self._lock:
            self._keys[(id(store), key)] = (store, value.encode())
        store.set(key, value)

    def repair(self) -> None:
        with self._lock:
            items = [(store, key, value) for (_, key), (store, value) in self._keys.items()]
        for store, key, value in items:
            if not store.check([key]) or store.get(key) != value:
                store.set(key, value)
                self.repaired += 1
                log.warning("store key %s was changed by someone else: put back", key)


class AdmissionDesk:
    """Answers announced joins in their order on a thread of its own; ``admit(rank)`` decides
    (``ADMITTED`` or the reason for the trainer)."""

    def __init__(self, store, admit: Callable[[int], str], published: PublishedKeys,
                 admit_server: Callable[[int], str] | None = None) -> None:
        self.store = store
        self.admit = admit
        self.admit_server = admit_server
        """Decides a server process's request (``s<rank>``); None: only trainers join."""
        self.published = published
        self._next_rpc_id = 1  # 0 is the server
        self._incarnations: dict[int | str, int] = {}
        self._handled = 0
        self._waiting: dict[int, float] = {}  # announced, not written yet: since when
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="psserver-admission", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.published.repair()
                self.poll()
            except Exception:  # noqa: BLE001 - the thread must outlive any one failure (the store's)
                log.exception("admission error")
                self._stop.wait(1.0)

    def poll(self) -> None:
        """Answer what was announced since the last poll."""
        announced = self._announced()
        if announced < self._handled:
            log.warning("the join counter went back from %d to %d (written by someone else): following it",
                        self._handled, announced)
            self._handled, self._waiting = announced, {}
        if announced - self._handled > MAX_BACKLOG:
            log.warning("the join counter jumped from %d to %d: looking at the last %d joins only",
                        self._handled, announced, MAX_BACKLOG)
            self._handled, self._waiting = announced - MAX_BACKLOG, {}
        now = time.monotonic()
        done = set()
        for seq in range(self._handled + 1, announced + 1):
            if self._stop.is_set():
                return
            key = KEY_ADMIT_REQUEST.format(seq=seq)
            if self.store.check([key]):
                self.store.set(KEY_ADMIT_ANSWER.format(seq=seq), self.answer(self.store.get(key)))
                self.store.delete_key(key)
                done.add(seq)
            elif now - self._waiting.setdefault(seq, now) >= UNWRITTEN_S:
                done.add(seq)  # its trainer died between announcing and writing
        while self._handled + 1 in done:
            self._handled += 1
            self._waiting.pop(self._handled, None)

    def _announced(self) -> int:
        try:
            return int(self.store.add(KEY_ADMIT_SEQ, 0))
        except (RuntimeError, ValueError):  # not a number: someone else wrote it
            log.warning("the join counter %s holds no number (written by someone else): reset", KEY_ADMIT_SEQ)
            self.store.set(KEY_ADMIT_SEQ, str(self._handled))
            return self._handled

    def answer(self, request: bytes) -> str:
        """The answer to one announced join: a failure here must not stop the others."""
        text = request.decode(errors="replace") if len(request) <= MAX_REQUEST_BYTES else ""
        server = self.admit_server is not None and text.startswith(SERVER_REQUEST_PREFIX)
        what = "server" if server else "rank"
        try:
            rank = int(text[len(SERVER_REQUEST_PREFIX):] if server else text)
        except ValueError:
            return f"malformed join request {request[:MAX_REQUEST_BYTES]!r}"
        if not 0 <= rank < 2**31:
            return f"{what} {rank} is out of range"
        try:
            decision = self.admit_server(rank) if server else self.admit(rank)  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001 - answered, logged with its traceback
            log.exception("admitting a join of %s %d failed", what, rank)
            return f"the server failed to admit a join of {what} {rank} ({str(e).splitlines()[0] if str(e) else e!r})"
        if decision != ADMITTED:
            return decision
        if self._next_rpc_id > MAX_RPC_ID:
            return f"this server has seen {MAX_RPC_ID} joins: restart it (with --resume) to reset RPC ids"
        rpc_id, self._next_rpc_id = self._next_rpc_id, self._next_rpc_id + 1
        key: int | str = f"s{rank}" if server else rank
        incarnation = self._incarnations.get(key, 0) + 1
        self._incarnations[key] = incarnation
        return f"{ADMITTED} {rpc_id} {incarnation}"
