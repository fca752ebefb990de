"""This server process's part of the model copied at one exact global step: the pieces of a
version of a model spread over several server processes
(``psserver.server.group.server_group.ServerGroup.model_version``).

With synchronous updates every server process applies round r as its global step r (server 0
decides the rounds), so parts copied at the same step make one whole version: never a piece of
step r beside a piece of step r + 1. A part is copied under the update lock, at once when the
process is at the step asked for, else by the updater as it applies that step (before any later
one can start); a process already past it answers None and server 0 asks again for a later one.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

log = logging.getLogger(__name__)

MAX_WANTED = 16
"""Steps asked for and not yet reached that are kept (server 0 asks for one at a time)."""

Part = tuple[torch.Tensor, torch.Tensor | None]
"""This process's parameters as one flat CPU buffer in its shards' order (a partition: its
pieces in the plan's order), and the model's buffers flat where this process holds them."""


class StepCopies:
    def __init__(self, engine: Any) -> None:
        """``engine``: the ``StepEngine`` it copies from (its updater, shards, buffers, compute thread)."""
        self.engine = engine
        self._wanted: dict[int, Future] = {}

    def at(self, step: int, timeout: float) -> Part | None:
        """This process's part at global step ``step``: copied now when it is at it, else when
        it applies it (waiting up to ``timeout`` s); None when it is past it or the wait ran out."""
        engine = self.engine

        def now_or_later() -> Part | Future | None:
            with engine.updater.lock:
                at = engine.updater.global_step
                if at > step:
                    return None
                if at == step:
                    return self._copy()
                if step not in self._wanted and len(self._wanted) >= MAX_WANTED:
                    self._wanted.pop(min(self._wanted)).set_result(None)
                return self._wanted.setdefault(step, Future())

        got = engine.compute.run(now_or_later)
        if not isinstance(got, Future):
            return got
        try:
            return got.result(timeout)
        except FutureTimeout:
            return None

    def applied(self, step: int) -> None:
        """(the update lock held, by the updater) ``step`` is applied: the parts waited for at
        it are copied now; those of earlier steps will never be (they were passed)."""
        if not self._wanted:
            return
        for s in [s for s in self._wanted if s < step]:
            self._wanted.pop(s).set_result(None)
        wanted = self._wanted.pop(step, None)
        if wanted is not None:
            wanted.set_result(self._copy())

    def _copy(self) -> Part:
        """(the update lock held) Every shard's parameters as they are now, and the buffers."""
        engine = self.engine
        flats = []
        for shard in engine.shards:
            with shard.lock:
                shard.after_updates()
                flats.extend(p.detach().reshape(-1).to("cpu") for p in shard.params)
        params = torch.cat(flats) if flats else torch.empty(0)
        return params, engine.buffers.flat() if engine.buffers is not None else None
