"""How trainers' gradients become optimizer steps: ``async``, ``sync`` and ``ssp``.

All receive one complete gradient per trainer step, so a trainer that dies mid-step
contributes nothing: an update is applied whole or not at all. ``on_step(step, samples)`` is
called after each optimizer step *outside* the updater's lock: a listener may take a
checkpoint, which copies the shards under that lock on another thread.

Every updater also keeps each live trainer's :class:`TrainerProgress`: its *clock* (the steps
it started here) and the *staleness* of its updates (how many optimizer steps landed between
the start of its step and its own update). ``ssp`` bounds the clocks; the others only report
them, so an operator sees the real lag of ``async`` as well.

A trainer *takes part* from its first attempt to start a step (``wait_turn``, ``try_start``
or ``step_opened``), not from its join: what it does in between (load its data, build its
replica) holds nobody back. It enters at the slowest clock of those taking part.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch
from torch import nn

from psserver.server.engine.lr_schedule import LRSchedule
from psserver.server.engine.shard import Shard

log = logging.getLogger(__name__)

Grads = dict[nn.Parameter, torch.Tensor]
T = TypeVar("T")
OnStep = Callable[[int, int], None]


class UpdateJournal(Protocol):
    """Told around every update, under the updater's lock (the engine, which keeps each
    trainer's last gradient applied, and through it ``psserver.server.state.memory``, which
    keeps the state where a restarted process finds it)."""

    def begin(self, global_step: int, samples: int, trainers: list[str]) -> None:
        """The update that will be ``global_step``, of ``samples`` samples, from ``trainers``'
        gradients, is about to be applied in place."""

    def commit(self) -> None:
        """That update is whole."""

_DEPARTED_KEPT = 256
"""Trainers that left whose last progress is kept for status (as membership keeps its history)."""


@dataclass
class TrainerProgress:
    """Where one trainer stands, in its own steps and in the server's optimizer steps."""

    clock: int = 0
    """Steps it started on this server. A trainer enters at the slowest clock of the trainers
    taking part, as if it had ended that many steps, so it never holds the others back (``ssp``)."""
    done: int = 0
    """Steps of the clock that ended: the update applied (sync: handed to its round) or the
    step given up. ``clock - done`` is 1 while a step is open, else 0."""
    opened_at: int | None = None
    """Global step of the weights its open step computes on: when the step started (an
    overlapping trainer's: when its step before started); None when none is open."""
    staleness: int = 0
    """Of its latest update: optimizer steps applied between the start of its step and the
    update (0: computed on the current weights)."""
    max_staleness: int = 0
    """The largest ``staleness`` of any of its updates."""
    updates: int = 0
    """Its gradients applied (sync: summed into a round); dropped steps do not count."""
    received_bytes: int = 0
    """Bytes of its pseudo-gradients received (``--step diloco``), as they travelled."""


class Updater:
    """Base: counts optimizer steps and reports each to ``on_step``; keeps every live trainer's
    :class:`TrainerProgress`.

    The progress has its own condition (``_clocks``), never held while the optimizer's lock is
    taken: a waiter of ``ssp`` and the status only contend with the bookkeeping, not with an
    update being applied.
    """

    mode = "async"

    def __init__(self, shards: list[Shard], on_step: OnStep) -> None:
        self.shards = shards
        self.on_step = on_step
        self.global_step = 0
        self.applied_hook: Callable[[int], None] | None = None
        """Called with each step as it is applied, the lock held (``psserver.server.engine.step_copies``)."""
        self._param_shard = {p: s for s in shards for p in s.params}
        self._clocks = threading.Condition()
        self._joined: set[str] = set()  # live, no step tried yet: they bound nobody
        self._progress: dict[str, TrainerProgress] = {}  # live, taking part
        self._departed: dict[str, TrainerProgress] = {}  # the last ones that left, as they left
        self._lag: dict[str, int] = {}  # overlapping trainers: 1 (a step computes on the reply before the last)
        self._last_read: dict[str, int] = {}  # the global step of the weights each last read here
        self._closed = False
        self.buffers = None
        """The model's buffers (``psserver.common.tensors.ServerBuffers``), committed with each update
        (sync: a round's contributors')."""
        self.tables = None
        """The embedding tables (``psserver.server.sparse.tables.SparseTables``) that take a step's
        row gradients, applied with its dense ones (sync: a round's, summed per id)."""
        self.lr_schedule: LRSchedule | None = None
        """The learning-rate schedule (``psserver.server.engine.lr_schedule``): it sets the learning rate of
        every update and steps once after it (the tables' rows keep theirs)."""
        self.journal: UpdateJournal | None = None
        """Told before and after every update (None: nobody)."""

    def _begin_update(self, samples: int, trainers: list[str]) -> None:
        """(lock held) Before an update touches any tensor (``global_step`` does not count it yet)."""
        if self.journal is not None:
            self.journal.begin(self.global_step + 1, samples, trainers)

    def _end_update(self) -> None:
        """(lock held) After the update: every tensor holds it, ``global_step`` counts it."""
        if self.journal is not None:
            self.journal.commit()
        if self.applied_hook is not None:
            self.applied_hook(self.global_step)

    def _schedule_lr(self) -> None:
        """(lock held) Before the update at ``global_step``: the schedule's learning rate into
        every shard's optimizer; at DEBUG, the one the first optimizer will apply."""
        optimizers = [s.optimizer for s in self.shards if s.optimizer is not None]
        if self.lr_schedule is not None:
            self.lr_schedule.apply(optimizers)
        if optimizers and log.isEnabledFor(logging.DEBUG):
            log.debug("learning rate at step %d: %r", self.global_step, optimizers[0].param_groups[0]["lr"])

    def _step_lr(self) -> None:
        """(lock held) After an update (``global_step`` counted it): the schedule's next step."""
        if self.lr_schedule is not None:
            self.lr_schedule.step()

    def set_shards(self, shards: list[Shard]) -> None:
        """The shards it updates (a server that learns its model from a trainer gets them then)."""
        self.shards = shards
        self._param_shard = {p: s for s in shards for p in s.params}

    def _run_on(self, p: object, work: Callable[[], T], *received: torch.Tensor) -> T:
        """``work()`` on the stream of the shard that holds ``p`` (``Shard.run``); as it is for
        what no shard holds (an embedding table's rows, on the CPU)."""
        shard = self._param_shard.get(p)  # type: ignore[call-overload]
        return work() if shard is None else shard.run(work, *received)

    def _split(self, grads: Grads) -> dict[Shard, Grads]:
        out: dict[Shard, Grads] = {s: {} for s in self.shards}
        for p, g in grads.items():
            shard = self._param_shard.get(p)
            if shard is not None:
                out[shard][p] = g
        return out

    @property
    def lock(self):
        """Held while an update is applied: hold it to see all shards at one step."""
        raise NotImplementedError

    def submit(self, trainer: str, grads: Grads | None, samples: int) -> None:
        """The whole gradient of ``trainer``'s open step; the step ends once it is applied
        (sync: handed to its round). None: the step was dropped (its gradient was not finite):
        nothing is applied, but a sync round counts the trainer as arrived."""
        raise NotImplementedError

    def wait_turn(self, trainer: str, timeout: float) -> None:
        """Block until ``trainer`` may start its next step, at most ``timeout`` s
        (``TimeoutError``); ``close()`` releases it. Async: never blocks."""

    def wait_applied(self, trainer: str, timeout: float) -> None:
        """Block until ``trainer``'s last update is in the weights (sync: its round applied),
        before it reads them for anything but a step (evaluation). Others: never blocks."""

    def try_start(self, trainer: str) -> bool:
        """``wait_turn`` without waiting, *whatever the trainer's open step's update does*:
        True when the next step may start now (it is granted: call ``step_opened`` next), so
        the one-round-trip protocols end one step and start the next in one hand-off to the
        compute thread; False: end the step, then ``wait_turn``. Async: always True."""
        return True

    def _take_grant(self, trainer: str) -> bool:
        """(``_clocks`` held) Whether ``trainer``'s clock already ticked for the step it opens."""
        return False

    # ---- membership and progress ---------------------------------------------------------

    def trainer_joined(self, trainer: str) -> None:
        """``trainer`` is live; it takes part from its first attempt to start a step."""
        with self._clocks:
            if trainer not in self._progress:
                self._joined.add(trainer)

    def set_lag(self, trainer: str, lag: int) -> None:
        """``trainer`` computes each step on the parameters it got ``lag`` steps before (1: it
        overlaps a step with the call that hands in the one before, ``--overlap``; 0: none).
        Its updates' staleness counts from those parameters, and ``ssp`` holds it ``lag``
        steps tighter, so that its gradients too are at most ``--staleness`` behind."""
        if lag not in (0, 1):
            raise ValueError(f"a trainer's lag is 0 or 1, got {lag!r}")
        with self._clocks:
            self._lag[trainer] = lag

    def _enter(self, trainer: str) -> TrainerProgress | None:
        """(``_clocks`` held) ``trainer``'s progress, entering it first if it joined and never
        tried a step: at the slowest started clock ``m`` of those taking part (0 when none), as
        if it had ended ``m`` steps. That tightens no one's bound: a trainer asking for step
        ``k`` needs every other at ``k - S`` or more; for the slowest ``k - S <= m``, and
        anyone else already needs as much of the slowest. None for a trainer that is not live."""
        p = self._progress.get(trainer)
        if p is None and trainer in self._joined:
            self._joined.discard(trainer)
            start = min((q.clock for q in self._progress.values()), default=0)
            p = self._progress[trainer] = TrainerProgress(clock=start, done=start)
        return p

    def trainer_gone(self, trainer: str) -> None:
        """``trainer`` left or was lost: it bounds nobody any more; its last progress is kept for status."""
        with self._clocks:
            self._joined.discard(trainer)
            self._lag.pop(trainer, None)
            self._last_read.pop(trainer, None)
            p = self._progress.pop(trainer, None)
            if p is not None:
                p.opened_at = None
                self._departed[trainer] = p
                for name in list(self._departed)[:-_DEPARTED_KEPT]:
                    del self._departed[name]
            self._clocks.notify_all()

    def step_opened(self, trainer: str, read: bool = True) -> None:
        """``trainer`` starts a step (its clock ticks), on the weights of the current global step
        unless ``read`` is False.

        A step still open is given up by the new one. A trainer that is not live (it left while
        this call was on its way) is not tracked: it must not bound the others again.
        ``read=False``: the step's weights were not read here (a gradient made before a rejoin,
        which opens its step as it arrives), so the weights the trainer reads next are what it
        computes its next step on, overlapping or not.
        """
        with self._clocks:
            p = self._enter(trainer)
            if p is None:
                return
            if p.opened_at is not None:
                p.done += 1
            if not self._take_grant(trainer):
                p.clock += 1
            last = self._last_read.get(trainer)
            if read:
                self._last_read[trainer] = self.global_step
            # An overlapping trainer's step computes on the parameters of the step before's reply.
            p.opened_at = last if self._lag.get(trainer) and last is not None else self.global_step
            self._clocks.notify_all()

    def step_closed(self, trainer: str) -> None:
        """``trainer``'s open step ended (update applied or step given up); idempotent."""
        with self._clocks:
            p = self._progress.get(trainer)
            if p is None or p.opened_at is None:
                return
            p.opened_at = None
            p.done += 1
            self._clocks.notify_all()

    def _note_update(self, trainer: str, before: int) -> None:
        """``trainer``'s update met the weights at global step ``before``: count it, record its
        staleness."""
        with self._clocks:
            p = self._progress.get(trainer)
            if p is None:
                return
            p.updates += 1
            if p.opened_at is None:
                return
            p.staleness = max(0, before - p.opened_at)
            p.max_staleness = max(p.max_staleness, p.staleness)

    def note_bytes(self, trainer: str, n: int) -> None:
        """``n`` bytes of ``trainer``'s pseudo-gradient arrived."""
        with self._clocks:
            p = self._progress.get(trainer)
            if p is not None:
                p.received_bytes += n

    def clocks(self) -> dict[str, int]:
        """The clocks of the live trainers taking part, read at one instant."""
        with self._clocks:
            return {name: p.clock for name, p in self._progress.items()}

    def progress_of(self, trainers: list[str]) -> dict[str, TrainerProgress]:
        """Copies of the progress of those of ``trainers`` known, read at one instant (the
        clocks of a status agree with each other)."""
        with self._clocks:
            out = {t: self._progress.get(t) or self._departed.get(t) for t in trainers}
            return {t: dataclasses.replace(p) for t, p in out.items() if p is not None}

    def progress(self, trainer: str) -> TrainerProgress | None:
        """A copy of ``trainer``'s progress: live, or as it was when it left; None if unknown."""
        with self._clocks:
            p = self._progress.get(trainer) or self._departed.get(trainer)
            return None if p is None else dataclasses.replace(p)

    def close(self) -> None:
        """Release every waiter (the server is stopping)."""
        with self._clocks:
            self._closed = True
            self._clocks.notify_all()


class AsyncUpdater(Updater):
    """Hogwild-style with locks: each trainer's gradient is one step of the shared optimizer."""

    mode = "async"

    def __init__(self, shards: list[Shard], on_step: OnStep) -> None:
        super().__init__(shards, on_step)
        self._lock = threading.RLock()

    @property
    def lock(self):
        return self._lock

    def submit(self, trainer: str, grads: Grads | None, samples: int) -> None:
        if grads is None:
            self.step_closed(trainer)
            return
        with self._lock:
            before = self.global_step
            self._begin_update(samples, [trainer])
            self._schedule_lr()
            for shard, g in self._split(grads).items():
                shard.apply(g)
            if self.tables is not None:
                self.tables.apply(grads)
            if self.buffers is not None:
                self.buffers.commit()
            self.global_step += 1
            self._step_lr()
            self._end_update()
            step = self.global_step
        self._note_update(trainer, before)
        self.step_closed(trainer)
        self.on_step(step, samples)


class SSPUpdater(AsyncUpdater):
    """Stale synchronous parallel (Ho et al., NIPS 2013): async, with bounded staleness.

    Every gradient is one step of the shared optimizer as it arrives (as ``async``), but a
    trainer's clock (the steps it started) never runs more than S ahead of the slowest live
    trainer's: it may start its step k only once every other live trainer has started, or
    asked to start, its step k - S. Asking to start step k - S means its step k - S - 1 ended,
    so the weights of step k hold every live trainer's updates up to its step k - S - 1.
    Starting is granted under one lock, to every trainer whose condition holds, together: two
    trainers that both ask for step k with S = 0 start it at the same instant, so ``S = 0`` is
    bulk-synchronous and at every moment ``max(clock) - min(clock) <= S`` over the live
    trainers (what ``psserver status`` shows).

    The bound follows membership, as the sync barrier does: a trainer that leaves or is
    evicted (dead, hung) bounds nobody any more, so it holds the others at most until
    ``--trainer-timeout`` evicts it; one that joins bounds nobody until it asks for its first
    step, and then enters at the slowest clock, so it holds nobody back. Waiting happens in
    ``wait_turn`` on the caller's (RPC) thread, never on the compute thread that applies the
    updates.
    """

    mode = "ssp"

    def __init__(self, shards: list[Shard], on_step: OnStep, staleness: int) -> None:
        super().__init__(shards, on_step)
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.staleness = staleness
        self._asking: dict[str, int] = {}  # trainer -> the step it waits to start
        self._granted: set[str] = set()  # clock ticked, its step not opened yet

    def _blocker(self, trainer: str, k: int) -> str | None:
        """(``_clocks`` held) A live trainer that keeps ``trainer`` from starting step ``k``."""
        need = k - self.staleness + self._lag.get(trainer, 0)
        for name, other in self._progress.items():
            if name != trainer and max(other.clock, self._asking.get(name, 0)) < need:
                return name
        return None

    def _grant(self) -> None:
        """(``_clocks`` held) Start every asking trainer that may start, until none more may
        (one's start can let another's)."""
        granted = False
        changed = True
        while changed:
            changed = False
            for name, k in list(self._asking.items()):
                if self._blocker(name, k) is None:
                    del self._asking[name]
                    self._progress[name].clock = k
                    self._granted.add(name)
                    changed = granted = True
        if granted:
            self._clocks.notify_all()

    def _ask(self, trainer: str) -> int | None:
        """(``_clocks`` held) ``trainer`` asks for its next step; the step, or None when it needs
        no grant (closed, not live, already granted)."""
        if self._closed:
            return None
        p = self._enter(trainer)
        if p is None or trainer in self._granted:
            return None
        k = self._asking[trainer] = p.clock + 1
        self._grant()
        return None if trainer in self._granted else k

    def _take_grant(self, trainer: str) -> bool:
        if trainer in self._granted:
            self._granted.discard(trainer)
            return True
        return False

    def try_start(self, trainer: str) -> bool:
        # Sound before the trainer's own update: a grant depends on the others' clocks only.
        with self._clocks:
            if self._ask(trainer) is None:
                return True
            del self._asking[trainer]  # it asks again from wait_turn, once its step has ended
            return False

    def wait_turn(self, trainer: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._clocks:
            k = self._ask(trainer)
            if k is None:
                return
            log.debug("ssp: %s waits to start its step %d for %s (--staleness %d)", trainer, k,
                      self._blocker(trainer, k), self.staleness)
            while trainer in self._asking and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    blocker = self._blocker(trainer, k)
                    del self._asking[trainer]
                    other = self._progress.get(blocker) if blocker else None
                    at = other.clock if other else "?"
                    lag = self._lag.get(trainer, 0)
                    raise TimeoutError(
                        f"ssp: {trainer} waited {timeout:g}s to start its step {k} for {blocker} to reach its step "
                        f"{k - self.staleness + lag} (--staleness {self.staleness}"
                        f"{', one tighter for an overlapping trainer' if lag else ''}); it is at {at}")
                self._clocks.wait(remaining)
            self._asking.pop(trainer, None)

    def trainer_gone(self, trainer: str) -> None:
        with self._clocks:
            self._asking.pop(trainer, None)
            self._granted.discard(trainer)
        super().trainer_gone(trainer)
        with self._clocks:
            self._grant()  # it bounds nobody any more
