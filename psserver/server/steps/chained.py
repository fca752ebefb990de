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

import threading

import torch

from psserver.server.steps.base import ServerHalf, register


class ChainedServer(ServerHalf):
    ops = ("step",)

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._outputs: dict[str, torch.Tensor] = {}  # trainer -> output of its open step
        self._lock = threading.Lock()

    def step(self, trainer: str, grad_out: torch.Tensor | None, x: torch.Tensor | None) -> torch.Tensor | None:
        """The backward and update of ``trainer``'s last step (``grad_out``; None: drop it), then
        the forward of its next batch ``x`` (None: only hand in the last gradient)."""
        return self.finish_then_start(trainer, lambda: self._backward(trainer, grad_out),
                                      None if x is None else lambda: self._forward(trainer, x))

    def _backward(self, trainer: str, grad_out: torch.Tensor | None) -> None:
        with self._lock:
            out = self._outputs.pop(trainer, None)
        if out is None:
            if grad_out is not None:
                raise RuntimeError(f"{trainer} sent an output gradient but has no forward pending on this server")
            return
        if grad_out is None:  # given up (the trainer's call failed): nothing is applied
            self.engine.drop_step(trainer)
            return
        try:
            if tuple(grad_out.shape) != tuple(out.shape):
                raise ValueError(f"output gradient of shape {tuple(grad_out.shape)} does not match the output "
                                 f"{tuple(out.shape)}")
            params = self.engine.trainable
            grads = torch.autograd.grad(out, params, grad_outputs=grad_out.to(out.device), allow_unused=True)
        except BaseException:
            self.engine.drop_step(trainer)
            raise
        self.engine.submit(trainer, {p: g for p, g in zip(params, grads, strict=True) if g is not None})

    def _forward(self, trainer: str, x: torch.Tensor) -> torch.Tensor:
        self.engine.open_step(trainer, int(x.shape[0]))
        try:
            out = self.engine.forward(x, clone=self.engine.needs_clone())
        except BaseException:
            self.engine.drop_step(trainer)
            raise
        with self._lock:
            self._outputs[trainer] = out
        return out.detach().to("cpu")

    def trainer_gone(self, trainer: str, evicted: bool) -> None:
        with self._lock:
            self._outputs.pop(trainer, None)

    def pending(self) -> int:
        """Trainers whose forward awaits its gradient."""
        with self._lock:
            return len(self._outputs)


register('chained', ChainedServer)
