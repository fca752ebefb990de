"""What keeps one trainer's bad step out of the model every trainer shares.

A trainer fed a corrupt batch, or whose loss overflowed, sends a gradient with NaN or inf in it.
Applied, it turns every parameter it touches into NaN for good: every later trainer reads the
poisoned weights, its loss is NaN and its accuracy chance. So every gradient is checked before
it reaches the optimizer: one whose norm is not finite is dropped whole (the step counts for
nothing, the trainer is told), and ``--max-grad-norm`` clips each trainer's step to a norm, as
``torch.nn.utils.clip_grad_norm_`` would on one machine. A trainer that keeps sending non-finite
gradients (``--max-nonfinite-steps`` in a row) is evicted with a reason its operator can read.

No RPC here: the engine asks, the endpoint tells the trainer and evicts.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch
from torch import nn

from psserver.common.tensors import total_norm

Grads = dict[nn.Parameter, torch.Tensor]


@dataclass
class GuardCounts:
    """One trainer's record, for status and metrics."""

    nonfinite: int = 0
    """Its gradients dropped because their norm was NaN or inf."""
    clipped: int = 0
    """Its steps scaled down to ``--max-grad-norm``."""
    streak: int = 0
    """Non-finite gradients in a row (a finite one resets it)."""


class GradientGuard:
    """Checks and clips each trainer's gradient; counts what it did per trainer."""

    def __init__(self, max_norm: float | None, max_nonfinite: int) -> None:
        self.max_norm = max_norm
        self.max_nonfinite = max_nonfinite
        self._lock = threading.Lock()
        self._counts: dict[str, GuardCounts] = {}
        self._notices: dict[str, list[str]] = {}
        self.nonfinite_total = 0
        self.clipped_total = 0

    def check(self, trainer: str, grads: Grads, norm: float | None = None) -> Grads | None:
        """``grads`` as they may be applied (scaled when above ``max_norm``), or None: not
        finite, drop the step. ``norm``: the whole step's gradient norm, when ``grads`` is only
        this server's partition of it (every server then decides the same way); a partition
        that is not finite itself is dropped whatever the norm said (a trainer's word alone
        never lets NaN into the model)."""
        local = total_norm(list(grads.values()))
        if norm is None or not math.isfinite(local):
            norm = local
        if not math.isfinite(norm):
            with self._lock:
                c = self._counts.setdefault(trainer, GuardCounts())
                c.nonfinite += 1
                c.streak += 1
                self.nonfinite_total += 1
                self._notices.setdefault(trainer, []).append(
                    f"the server dropped a step of this trainer: its gradient norm is {norm} "
                    f"({c.streak} non-finite in a row; evicted at {self.max_nonfinite})")
            return None
        scale = None
        if self.max_norm is not None and norm > self.max_norm:
            scale = self.max_norm / (norm + 1e-6)
        with self._lock:
            c = self._counts.setdefault(trainer, GuardCounts())
            c.streak = 0
            if scale is not None:
                c.clipped += 1
                self.clipped_total += 1
        if scale is None:
            return grads
        return {p: g * scale for p, g in grads.items()}

    def take_notices(self, trainer: str) -> list[str]:
        """What ``trainer`` should be told since its last call (its reply carries them)."""
        with self._lock:
            return self._notices.pop(trainer, [])

    def must_evict(self, trainer: str) -> str | None:
        """The reason to evict ``trainer`` (its non-finite streak reached the limit), else None."""
        with self._lock:
            c = self._counts.get(trainer)
            if c is None or c.streak < self.max_nonfinite:
                return None
            return f"sent {c.streak} non-finite gradients in a row (--max-nonfinite-steps {self.max_nonfinite})"

    def counts(self, trainer: str) -> GuardCounts:
        with self._lock:
            c = self._counts.get(trainer)
            return GuardCounts() if c is None else GuardCounts(c.nonfinite, c.clipped, c.streak)

    def forget(self, trainer: str) -> None:
        """``trainer`` is gone: its notices go; its counts stay for status (bounded by history)."""
        with self._lock:
            self._notices.pop(trainer, None)
            c = self._counts.get(trainer)
            if c is not None:
                c.streak = 0
            if len(self._counts) > 1024:
                for name in list(self._counts)[:-512]:
                    del self._counts[name]
