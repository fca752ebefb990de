"""``--step chained``: one round trip per step, the loss still on the trainer.

A plain step costs three round trips; on a 2-core host each is 1.5-2.5 ms of a ~45 ms step.
But a trainer knows its next batch before it sends the last step's output gradient, so one
message can carry both: call *t* brings the gradient of output *t-1* and batch *t*; the
server runs the backward of step *t-1*, applies its update, then runs the forward of batch
*t* and returns output *t*. The server's order of work is the plain step's (update *t-1*
lands before forward *t*), so the arithmetic is the same; only the round trips go. The
trainer differentiates its own loss with respect to the output (any loss), and a last call
without a batch hands in the final gradient, before it evaluates or leaves.

Between two calls the server holds the step's graph (its activations), as a
``dist_autograd`` context holds it between forward and backward. A trainer that dies or is
evicted in between contributes nothing: its open step is dropped whole. All of it runs on
the engine's compute thread, so the server's OpenMP workers stay hot.
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
