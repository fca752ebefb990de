"""``--update sync``: one optimizer step per round of K gradients, averaged (:class:`SyncUpdater`),
and, on a server process of rank > 0, the same rounds as server 0 decides them
(:class:`FollowerSyncUpdater`). The base class and the other modes: ``psserver.server.engine.updates``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import torch
from torch import nn

from psserver.server.engine.shard import Shard
from psserver.server.engine.updates import Grads, OnStep, Updater

log = logging.getLogger(__name__)


class SyncUpdater(Updater):
    """One optimizer step per K gradients, averaged.

    The barrier follows membership: a round needs min(K, live trainers) contributions, so it
    never waits for a trainer that left or was lost, and it grows again when one joins. At a
    fresh start (:meth:`await_first_trainers`) the rounds wait for K trainers, for a while after
    the first joins: trainers launched together join a little apart, and the first one's rounds
    alone would not be the K-gradient steps asked for. A
    gradient's call returns at once; the trainer's next forward waits until its round is
    applied, which keeps RPC threads free and the optimizer's lock short.
    """

    mode = "sync"

    def __init__(self, shards: list[Shard], on_step: OnStep, k: int) -> None:
        super().__init__(shards, on_step)
        self.k = k
        self._cond = threading.Condition(threading.RLock())
        self._live: set[str] = set()
        self._round = 0  # rounds applied so far
        self._owed: dict[str, int] = {}  # trainer -> round its last gradient belongs to
        self._sums: dict[nn.Parameter, torch.Tensor] = {}
        self._contributors: set[str] = set()  # arrived in this round (a dropped step too)
        self._gradients = 0  # of them, those whose gradient is in the sums
        self._samples = 0
        self._awaited = 0  # trainers not (back) yet: a round waits for them too
        self._awaited_who = "of before the restart"
        self._first_wait: float | None = None  # await_first_trainers' bound, until the first join starts it
        self.mean_per_parameter = False
        """Average each parameter over the gradients of the round that carry it (streaming
        DiLoCo's fragments, where a round may mix fragments), not over all of them (a gradient
        without a parameter counts it as zero, as DDP does)."""
        self._carried: dict[nn.Parameter, int] = {}  # gradients of the round that carry each parameter
        self.round_listeners: list[Callable[[int, list[str]], None]] = []
        """Called with (round, its contributors) as each round closes, the lock held: server 0
        of several tells the others which round every gradient is in (:class:`FollowerSyncUpdater`)."""

    @property
    def lock(self):
        return self._cond

    @property
    def rounds(self) -> int:
        """Rounds closed so far."""
        return self._round

    def required(self) -> int:
        return max(1, min(self.k, len(self._live) + self._awaited))

    def await_rejoins(self, count: int, timeout: float) -> None:
        """The server process restarted from its state in memory, where ``count`` trainers had
        trained: until they are back (or ``timeout`` s pass) a round needs them too, so that the
        first trainer to rejoin does not make rounds alone that a run without the restart would
        not have made."""
        if count <= 0:
            return
        with self._cond:
            self._awaited, self._awaited_who = count, "of before the restart"
        log.info("sync: rounds wait up to %gs for the %d trainer(s) that trained before the restart", timeout, count)
        self._stop_awaiting_after(timeout)

    def await_first_trainers(self, timeout: float) -> None:
        """A fresh start: until K trainers have joined, or ``timeout`` s have passed since the
        first did, a round waits for the K (then it goes on with those that joined, as the
        barrier that follows membership does)."""
        with self._cond:
            if self._live or self.k <= 1:
                return
            self._awaited, self._awaited_who, self._first_wait = self.k, "expected", timeout

    def _stop_awaiting_after(self, timeout: float) -> None:
        timer = threading.Timer(timeout, self._stop_awaiting)
        timer.daemon = True
        timer.start()

    def _stop_awaiting(self) -> None:
        with self._cond:
            if not self._awaited:
                return
            log.warning("sync: %d trainer(s) %s did not join: rounds go on without them", self._awaited,
                        self._awaited_who)
            self._awaited = 0
            applied = self._maybe_apply()
            self._cond.notify_all()
        self._report(applied)

    def try_start(self, trainer: str) -> bool:
        return False  # its turn depends on the round its open step's gradient joins

    def trainer_joined(self, trainer: str) -> None:
        super().trainer_joined(trainer)
        with self._cond:
            if trainer not in self._live and self._awaited:
                self._awaited -= 1
            self._live.add(trainer)
            timeout, self._first_wait = self._first_wait, None
            if timeout is not None and self._awaited:
                log.info("sync: rounds wait up to %gs for %d more trainer(s) of K=%d", timeout, self._awaited,
                         self.k)
                self._stop_awaiting_after(timeout)

    def trainer_gone(self, trainer: str) -> None:
        super().trainer_gone(trainer)
        with self._cond:
            self._live.discard(trainer)
            self._owed.pop(trainer, None)
            applied = self._maybe_apply()
            self._cond.notify_all()
        self._report(applied)

    def departure(self, trainer: str) -> tuple[int, bool]:
        """What the other server processes need to know of ``trainer``'s leaving: the rounds
        closed by now, and whether its last gradient is in the round still open (a gone
        trainer's gradient stays in its round)."""
        with self._cond:
            return self._round, trainer in self._contributors

    def submit(self, trainer: str, grads: Grads | None, samples: int) -> None:
        with self._cond:
            if trainer in self._contributors:
                # Cannot happen through a step protocol (its forward waits); refuse rather
                # than count one trainer twice.
                raise RuntimeError(f"{trainer} sent two gradients for round {self._round + 1}")
            for p, g in (grads or {}).items():
                self._run_on(p, lambda p=p, g=g: self._add(p, g), g)  # the shard's stream: before its update
                self._carried[p] = self._carried.get(p, 0) + 1
            before = self.global_step
            self._contributors.add(trainer)
            if grads is not None:
                self._gradients += 1
                self._samples += samples
            self._owed[trainer] = self._round + 1
            applied = self._maybe_apply()
        if grads is not None:
            self._note_update(trainer, before)
        self.step_closed(trainer)
        self._report(applied)

    def _add(self, p: nn.Parameter, g: torch.Tensor) -> None:
        acc = self._sums.get(p)
        if acc is None:
            self._sums[p] = g.detach().clone()
        else:
            acc.add_(g)

    def _maybe_apply(self) -> tuple[int, int] | None:
        """Apply the round if it is complete (lock held); its (step, samples), else None. The
        average is over the gradients in it; a round of dropped steps only ends (no update)."""
        if not self._contributors or len(self._contributors) < self.required():
            return None
        n, samples = self._gradients, self._samples
        if n:
            self._begin_update(samples, sorted(self._contributors))
            self._schedule_lr()
            if self.mean_per_parameter:
                for p, carried in self._carried.items():
                    if carried != n:  # then scaled by 1/n with the others
                        self._run_on(p, lambda p=p, carried=carried: self._sums[p].mul_(n / carried))
            for shard, g in self._split(self._sums).items():
                shard.apply(g, scale=1.0 / n)
            if self.tables is not None:
                self.tables.apply(self._sums, scale=1.0 / n)
            if self.buffers is not None:
                self.buffers.commit(self._contributors)
        for listener in self.round_listeners:
            listener(self._round + 1, sorted(self._contributors))
        self._sums = {}
        self._carried = {}
        self._contributors = set()
        self._gradients = 0
        self._samples = 0
        self._round += 1
        self._cond.notify_all()
        if not n:
            return None
        self.global_step += 1
        self._step_lr()
        self._end_update()
        return self.global_step, samples

    def _report(self, applied: tuple[int, int] | None) -> None:
        if applied is not None:
            self.on_step(*applied)

    def wait_turn(self, trainer: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._closed and self._owed.get(trainer, 0) > self._round:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"sync round {self._round + 1} did not complete in {timeout:g}s")
                self._cond.wait(remaining)

    wait_applied = wait_turn

    def close(self) -> None:
        super().close()
        with self._cond:
            self._cond.notify_all()


class FollowerSyncUpdater(Updater):
    """``sync`` on a server process of rank > 0: server 0 decides which gradients make each
    round (its :class:`SyncUpdater`, in the order they reached it), and this server applies the
    same rounds to its partition, so every partition of a step lands in the same round.

    A trainer's gradient waits here until server 0 names the round it is in (``decide``); rounds
    are applied in their order, each once all its gradients are here. A trainer that is gone
    before its gradient arrived (it died between its calls to two servers) is left out of the
    round here: the one case where partitions can differ by a step.

    Server 0's word that a trainer left and its rounds' decisions come by separate calls, in
    either order: a gone trainer's gradient is kept until every round that may hold it is
    decided (server 0 says which: :meth:`leaving`), and dropped only if none named it.
    """

    mode = "sync"

    def __init__(self, shards: list[Shard], on_step: OnStep) -> None:
        super().__init__(shards, on_step)
        self._cond = threading.Condition(threading.RLock())
        self._pending: dict[str, tuple[Grads | None, int]] = {}  # trainer -> its gradient, not applied yet
        self._decided: dict[int, list[str]] = {}  # round -> contributors, not applied yet
        self._next = 1  # the round to apply next
        self._leaving: dict[str, int | None] = {}  # server 0's word of a departure, until trainer_gone
        self._drop_after: dict[str, int] = {}  # gone trainer -> the last round that may hold its gradient

    @property
    def lock(self):
        return self._cond

    @property
    def rounds(self) -> int:
        return self._next - 1

    def start_at(self, rounds: int) -> None:
        """Server 0 has closed ``rounds`` rounds: the next one it decides is this server's next."""
        with self._cond:
            self._next = rounds + 1
            self._decided = {r: c for r, c in self._decided.items() if r > rounds}
            self._cond.notify_all()

    def try_start(self, trainer: str) -> bool:
        return False

    def submit(self, trainer: str, grads: Grads | None, samples: int) -> None:
        with self._cond:
            if trainer in self._pending:
                raise RuntimeError(f"{trainer} sent two gradients before its round was decided")
            self._pending[trainer] = (None if grads is None else {
                p: self._run_on(p, lambda g=g: g.detach().clone(), g) for p, g in grads.items()}, samples)
            applied = self._apply_ready()
        self.step_closed(trainer)
        self._report(applied)

    def decide(self, round_no: int, contributors: list[str]) -> None:
        """Server 0 closed ``round_no`` with these trainers' gradients (or dropped steps)."""
        with self._cond:
            if round_no >= self._next:
                self._decided[round_no] = list(contributors)
            applied = self._apply_ready()
        self._report(applied)

    def leaving(self, trainer: str, rounds_closed: int, in_open_round: bool) -> None:
        """Server 0's word, before :meth:`trainer_gone`: when ``trainer`` left it had closed
        ``rounds_closed`` rounds, and its last gradient was in the round still open or not."""
        with self._cond:
            self._leaving[trainer] = None if in_open_round else rounds_closed

    def _settle(self) -> None:
        """(lock held) Drop the gradients of gone trainers that no round will take: every round
        up to the last that may hold one is decided here, and none named it."""
        for trainer, last in list(self._drop_after.items()):
            if all(r in self._decided for r in range(self._next, last + 1)):
                if not any(trainer in names for names in self._decided.values()):
                    self._pending.pop(trainer, None)
                del self._drop_after[trainer]

    def _apply_ready(self) -> list[tuple[int, int]]:
        """(lock held) Apply every decided round whose gradients are all here, in order."""
        self._settle()
        applied = []
        while self._next in self._decided:
            names = [n for n in self._decided[self._next] if n in self._pending or n in self._progress or
                     n in self._joined]
            if any(n not in self._pending for n in names):
                break
            del self._decided[self._next]
            taken = [self._pending.pop(n) for n in names]
            grads = [g for g, _ in taken if g is not None]
            if grads:
                sums: Grads = {}
                for g in grads:
                    for p, t in g.items():
                        acc = sums.get(p)
                        sums[p] = t if acc is None else self._run_on(p, lambda acc=acc, t=t: acc.add_(t))
                samples = sum(s for g, s in taken if g is not None)
                self._begin_update(samples, names)
                self._schedule_lr()
                for shard, g in self._split(sums).items():
                    shard.apply(g, scale=1.0 / len(grads))
                if self.tables is not None:
                    self.tables.apply(sums, scale=1.0 / len(grads))
                self.global_step += 1
                self._step_lr()
                self._end_update()
                applied.append((self.global_step, samples))
            self._next += 1
            self._cond.notify_all()
        return applied

    def _report(self, applied: list[tuple[int, int]]) -> None:
        for step, samples in applied:
            self.on_step(step, samples)

    def wait_turn(self, trainer: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._closed and trainer in self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"sync round {self._next} was not decided by server 0 in {timeout:g}s")
                self._cond.wait(remaining)

    wait_applied = wait_turn

    def trainer_gone(self, trainer: str) -> None:
        super().trainer_gone(trainer)
        with self._cond:
            if trainer not in self._leaving:  # not server 0's word (a checkpoint loaded): nothing of it counts
                self._pending.pop(trainer, None)
                self._drop_after.pop(trainer, None)
            else:
                last = self._leaving.pop(trainer)
                if last is not None:
                    self._drop_after[trainer] = last
                # else: its gradient is in server 0's open round, which will name it
            applied = self._apply_ready()  # a round that waited for its gradient goes without it
            self._cond.notify_all()
        self._report(applied)

    def close(self) -> None:
        super().close()
        with self._cond:
            self._cond.notify_all()
