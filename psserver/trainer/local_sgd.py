"""The library's DiLoCo loop: the user's own inner optimizer, counted, and a sync every H of
its steps (``ps.local_sgd``), or the user's own explicit ``ps.sync()``.

::

    with psserver.connect("10.0.0.5:29500") as ps:      # a server of --update diloco
        model = ps.replica(Net())                       # the global weights; the anchor
        inner = torch.optim.AdamW(model.parameters(), lr=4e-4)
        ps.local_sgd(inner, every=100)                  # each 100th inner.step() syncs
        for x, y in loader:
            loss_fn(model(x), y).backward()
            inner.step()
            inner.zero_grad()

The inner optimizer and its state stay with the user; the server holds the global weights
and the outer optimizer (``psserver.server.steps.diloco``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


class LocalSGD:
    """A step post-hook on the user's inner optimizer: each of its steps is counted as an inner
    step of the window (its samples from the replica's forwards), and the H-th syncs."""

    def __init__(self, optimizer: torch.optim.Optimizer, on_step: Callable[[], None]) -> None:
        self.optimizer = optimizer
        self._on_step = on_step
        self._handle: Any = optimizer.register_step_post_hook(self._hook)

    def _hook(self, _optimizer: torch.optim.Optimizer, _args: tuple, _kwargs: dict) -> None:
        self._on_step()

    @property
    def active(self) -> bool:
        """Whether its steps are still counted (not removed)."""
        return self._handle is not None

    def remove(self) -> None:
        """Stop counting this optimizer's steps (its windows are then ``ps.sync()``'s)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
