"""Each trainer's gradients numbered, so that a gradient sent twice is applied once.

A trainer numbers the gradient of its step *k* with *k* (its steps in the run, across rejoins).
When its server process dies and comes back (``psserver.server.state.memory``), the trainer
rejoins and sends again the gradient whose reply it never got: if the dead process had applied
it, the restarted one knows (the last number applied per rank is kept with the state) and does
not apply it again; if not, it is applied now. Together with the state in memory that makes an
update land exactly once, whenever the process died.

The updater tells this journal before and after every update (``UpdateJournal``); it passes
that on, with the ranks and numbers of the update's gradients, to a durable journal (the state
in memory), and records them once the update is whole.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

log = logging.getLogger(__name__)

MAX_DEPARTED = 1024
"""Gradients of gone trainers kept for rounds still open (names are never used again)."""

Applied = list[tuple[int, int]]
"""(rank, number of its gradient) of each gradient in one update."""


class DurableJournal(Protocol):
    """Where the updates' records outlive the process (``psserver.server.state.memory``)."""

    def begin(self, global_step: int, samples: int, applied: Applied) -> None:
        """The update that will be ``global_step`` is about to be applied in place."""

    def commit(self) -> None:
        """That update is whole."""

    def forget_rank(self, rank: int) -> None:
        """A fresh trainer took ``rank``: its numbers start again at 1."""


class GradientSequences:
    """Ranks of the live trainers, the number of each one's gradient in flight, and the last
    number applied per rank."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ranks: dict[str, int] = {}
        self._sent: dict[str, int] = {}
        self.applied: dict[int, int] = {}
        """Rank -> the number of its last gradient applied (a sync round's, once the round is)."""
        self._pending: Applied = []
        self._departed: dict[str, tuple[int, int]] = {}
        """Trainer -> (rank, number) of a gradient it left behind in a sync round still open (a
        gone trainer's gradient stays in its round): recorded as applied when the round is, so
        that the trainer, rejoined, does not have it applied again."""
        self.durable: DurableJournal | None = None

    def joined(self, trainer: str, rank: int, steps: int) -> None:
        """``trainer`` holds ``rank``, having trained ``steps`` steps before (0: a fresh trainer,
        whose numbers start again)."""
        with self._lock:
            self._ranks[trainer] = rank
            if steps == 0:  # a fresh trainer on this rank: a gradient another left here is not its number
                for name in [n for n, (r, _) in self._departed.items() if r == rank]:
                    del self._departed[name]
            if steps == 0 and self.applied.pop(rank, None) is not None and self.durable is not None:
                self.durable.forget_rank(rank)

    def gone(self, trainer: str) -> None:
        with self._lock:
            rank, number = self._ranks.pop(trainer, None), self._sent.pop(trainer, None)
            if rank is not None and number is not None and number > self.applied.get(rank, 0):
                self._departed[trainer] = (rank, number)  # in a round still open, or dropped
                if len(self._departed) > MAX_DEPARTED:  # of rounds that never closed: the oldest go
                    del self._departed[next(iter(self._departed))]

    def applied_before(self, trainer: str, number: int) -> bool:
        """Whether ``trainer``'s gradient ``number`` was applied already (it sends it again after
        its server restarted); otherwise it is the one its open step hands in."""
        with self._lock:
            rank = self._ranks.get(trainer)
            if rank is not None and number <= self.applied.get(rank, 0):
                return True
            self._sent[trainer] = number
            return False

    # ---- UpdateJournal (the updater's lock held) -----------------------------------------------

    def begin(self, global_step: int, samples: int, trainers: list[str]) -> None:
        with self._lock:
            self._pending = []
            for t in trainers:
                left = self._departed.pop(t, None)  # a gradient it left in this round, if it is back since
                now = (self._ranks[t], self._sent[t]) if t in self._ranks and t in self._sent else None
                if now is not None and (left is None or now[1] >= left[1]):
                    self._pending.append(now)
                elif left is not None:
                    self._pending.append(left)
        if self.durable is not None:
            self.durable.begin(global_step, samples, self._pending)

    def commit(self) -> None:
        with self._lock:
            for rank, number in self._pending:
                self.applied[rank] = max(self.applied.get(rank, 0), number)
            self._pending = []
        if self.durable is not None:
            self.durable.commit()
