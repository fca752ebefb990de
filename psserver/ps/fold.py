"""``--step fold``: the optimizer step rides on the backward RPC instead of a third round trip.

A plain step costs three round trips: the forward RPC, ``dist_autograd.backward`` (the
output's gradient crosses, the server runs its part of the graph) and
``DistributedOptimizer.step``. The last one carries nothing the server does not already hold:
the gradient is on the server when its part of the backward ends. Folding taps every
parameter as it enters the forward (one autograd node per parameter, identity or the clone
that concurrency needs anyway); each tap's backward hands its gradient to the step's
:class:`FoldedStep` instead of the ``dist_autograd`` context, and the last one submits the
whole gradient to the updater, inside the backward RPC and before its reply.

Safe because a parameter's gradient is computed by the node that used the parameter, so when
the last gradient has arrived no node of this step still needs a weight; and because the
updater sees exactly what ``SharedOptimizer.step`` would have passed it, whole or not at all.
A parameter the forward did not use never reports: such a step is submitted when the same
trainer's next forward arrives, with the missing gradients as zero (as ``torch.optim`` treats
them).
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)

Grads = dict[nn.Parameter, torch.Tensor]


class FoldedStep:
    """The gradient of one trainer step, collected as the server's backward produces it."""

    def __init__(self, expected: int, samples: int, submit: Callable[[Grads, int], None]) -> None:
        self.expected = expected
        self.samples = samples
        self._submit = submit
        self._grads: Grads = {}
        self._lock = threading.Lock()
        self.done = False

    def add(self, p: nn.Parameter, grad: torch.Tensor) -> None:
        with self._lock:
            if self.done:
                return
            self._grads[p] = grad
            if len(self._grads) < self.expected:
                return
            self.done = True
        grads, self._grads = self._grads, {}
        self._submit(grads, self.samples)

    def flush(self) -> bool:
        """Submit an incomplete step (a parameter got no gradient); False if nothing was owed."""
        with self._lock:
            if self.done or not self._grads:
                self.done = True
                return False
            self.done = True
        grads, self._grads = self._grads, {}
        self._submit(grads, self.samples)
        return True


class _Tap(torch.autograd.Function):
    """Identity (or a clone) of a parameter whose gradient goes to a :class:`FoldedStep`."""

    @staticmethod
    def forward(ctx, p: nn.Parameter, step: FoldedStep, clone: bool) -> torch.Tensor:
        ctx.param, ctx.step = p, step
        return p.clone() if clone else p.view_as(p)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        ctx.step.add(ctx.param, grad)
        # Nothing flows on to the leaf: the dist_autograd context keeps no copy of the gradient.
        return None, None, None


def tap(p: nn.Parameter, step: FoldedStep, clone: bool) -> torch.Tensor:
    return _Tap.apply(p, step, clone)
