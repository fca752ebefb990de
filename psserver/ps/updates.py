"""How trainers' gradients become optimizer steps: ``async`` and ``sync``.

Both receive one complete gradient per trainer step, so a trainer that dies mid-step
contributes nothing: an update is applied whole or not at all. ``on_step(step, samples)`` is
called after each optimizer step *outside* the updater's lock: a listener may take a
checkpoint, which copies the shards under that lock on another thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch
from torch import nn

from psserver.ps.shard import Shard

Grads = dict[nn.Parameter, torch.Tensor]
OnStep = Callable[[int, int], None]


class Updater:
    """Base: counts optimizer steps and reports each to ``on_step``."""

    mode = "async"

    def __init__(self, shards: list[Shard], on_step: OnStep) -> None:
        self.shards = shards
        self.on_step = on_step
        self.global_step = 0
        self._param_shard = {p: s for s in shards for p in s.params}

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

    def submit(self, trainer: str, grads: Grads, samples: int) -> None:
        raise NotImplementedError

    def wait_turn(self, trainer: str, timeout: float) -> None:
        """Block a trainer's next forward until its last update is applied (sync only)."""

    def trainer_joined(self, trainer: str) -> None:
        pass

    def trainer_gone(self, trainer: str) -> None:
        pass

    def close(self) -> None:
        """Release every waiter (the server is stopping)."""


class AsyncUpdater(Updater):
    """Hogwild-style with locks: each trainer's gradient is one step of the shared optimizer."""

    mode = "async"

    def __init__(self, shards: list[Shard], on_step: OnStep) -> None:
        super().__init__(shards, on_step)
        self._lock = threading.RLock()

    @property
    def lock(self):
        return self._lock

    def submit(self, trainer: str, grads: Grads, samples: int) -> None:
        with self._lock:
            for shard, g in self._split(grads).items():
                shard.apply(g)
            self.global_step += 1
            step = self.global_step
        self.on_step(step, samples)


class SyncUpdater(Updater):
    """One optimizer step per K gradients, averaged.

    The barrier follows membership: a round needs min(K, live trainers) contributions, so it
    never waits for a trainer that left or was lost, and it grows again when one joins. A
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
        self._contributors: set[str] = set()
        self._samples = 0
        self._closed = False

    @property
    def lock(self):
        return self._cond

    def required(self) -> int:
        return max(1, min(self.k, len(self._live)))

    def trainer_joined(self, trainer: str) -> None:
        with self._cond:
            self._live.add(trainer)

    def trainer_gone(self, trainer: str) -> None:
        with self._cond:
            self._live.discard(trainer)
            self._owed.pop(trainer, None)
            applied = self._maybe_apply()
            self._cond.notify_all()
        self._report(applied)

    def submit(self, trainer: str, grads: Grads, samples: int) -> None:
        with self._cond:
            if trainer in self._contributors:
                # Cannot happen through a step protocol (its forward waits); refuse rather
                # than count one trainer twice.
                raise RuntimeError(f"{trainer} sent two gradients for round {self._round + 1}")
            for p, g in grads.items():
                acc = self._sums.get(p)
                if acc is None:
                    self._sums[p] = g.detach().clone()
                else:
                    acc.add_(g)
            self._contributors.add(trainer)
            self._samples += samples
            self._owed[trainer] = self._round + 1
            applied = self._maybe_apply()
        self._report(applied)

    def _maybe_apply(self) -> tuple[int, int] | None:
        """Apply the round if it is complete (lock held); its (step, samples), else None."""
        if not self._contributors or len(self._contributors) < self.required():
            return None
        n = len(self._contributors)
        for shard, g in self._split(self._sums).items():
            shard.apply(g, scale=1.0 / n)
        samples = self._samples
        self._sums = {}
        self._contributors = set()
        self._samples = 0
        self._round += 1
        self.global_step += 1
        self._cond.notify_all()
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

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def make_updater(mode: str, shards: list[Shard], on_step: OnStep, sync_trainers: int) -> Updater:
    if mode == "sync":
        return SyncUpdater(shards, on_step, sync_trainers)
    return AsyncUpdater(shards, on_step)
