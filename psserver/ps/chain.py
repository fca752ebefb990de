"""``--step chained``: one round trip per step, with the loss still on the trainer.

A plain step costs three round trips (forward, ``dist_autograd.backward``,
``DistributedOptimizer.step``); on a 2-core host each is 1.5-2.5 ms of a ~45 ms step. But a
trainer knows its next batch before it sends the last step's output gradient, so one message
can carry both: call *t* brings the gradient of output *t-1* and batch *t*; the server runs the
backward of step *t-1*, applies its update, then runs the forward of batch *t* and returns
output *t*. The server's order of work is the plain step's (update *t-1* lands before forward
*t*), so the arithmetic is the same; only the round trips go. The trainer differentiates its
own loss with respect to the output (any loss), and a last call without a batch hands in the
final gradient, before it evaluates or leaves.

Between two calls the server holds the step's graph (its activations), as a ``dist_autograd``
context holds it between forward and backward. A trainer that dies or is evicted in between
contributes nothing: its pending step is dropped whole.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)

Grads = dict[nn.Parameter, torch.Tensor]


@dataclass
class _Pending:
    out: torch.Tensor
    samples: int


class Chains:
    """The forward each chained trainer still owes a backward for."""

    def __init__(self, params: list[nn.Parameter], submit: Callable[[str, Grads, int], None]) -> None:
        self.params = [p for p in params if p.requires_grad]
        self._submit = submit
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()

    def backward(self, name: str, grad_out: torch.Tensor | None) -> None:
        """Finish ``name``'s pending step with ``grad_out`` (dL/d output) and submit its update.

        ``None`` drops a pending step (the trainer gave it up, e.g. after an error)."""
        with self._lock:
            pending = self._pending.pop(name, None)
        if grad_out is None:
            return
        if pending is None:
            raise RuntimeError(f"{name} sent an output gradient but has no forward pending on this server")
        if tuple(grad_out.shape) != tuple(pending.out.shape):
            raise ValueError(f"output gradient of shape {tuple(grad_out.shape)} does not match the output "
                             f"{tuple(pending.out.shape)}")
        grads = torch.autograd.grad(pending.out, self.params, grad_outputs=grad_out.to(pending.out.device),
                                    allow_unused=True)
        self._submit(name, {p: g for p, g in zip(self.params, grads) if g is not None}, pending.samples)

    def hold(self, name: str, out: torch.Tensor, samples: int) -> None:
        with self._lock:
            self._pending[name] = _Pending(out, samples)

    def drop(self, name: str) -> bool:
        """Forget ``name``'s pending step (trainer gone); True if there was one."""
        with self._lock:
            return self._pending.pop(name, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)
