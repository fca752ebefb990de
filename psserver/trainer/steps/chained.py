"""The trainer half of ``--step chained``: each call hands in the last step's output gradient
and the next batch; the loss and its gradient with respect to the output are computed here.

The protocol, its order of work and why: its server half, ``psserver.server.steps.chained``.
"""

from __future__ import annotations

import torch

from psserver.trainer.steps.base import TrainerHalf, register


class ChainedTrainer(TrainerHalf):
    def __init__(self, channel) -> None:
        super().__init__(channel)
        self._grad_out: torch.Tensor | None = None  # owed to the server

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        grad_out, self._grad_out = self._grad_out, None  # sent once, whatever the call's fate
        out = self.channel.call("step", grad_out, x)
        out.requires_grad_(True)
        loss = self.channel.loss_fn(out, y)
        (self._grad_out,) = torch.autograd.grad(loss, (out,))
        return float(loss.detach())

    def flush(self) -> None:
        grad_out, self._grad_out = self._grad_out, None
        if grad_out is not None:
            self.channel.call("step", grad_out, None)


register('chained', ChainedTrainer)
