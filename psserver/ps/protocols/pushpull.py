"""``--step pushpull``: trainer compute, one round trip per step, one flat buffer per shard.

Each call pushes the flat gradient of the trainer's step *t* (one buffer per server shard) and
pulls the flat parameters for its step *t+1*: the server applies the update, then copies the
parameters out at one step, both on its compute thread. The order of work is that of ``pull``
(the update of step *t* lands before the parameters of step *t+1* are read), with one round
trip instead of three and no autograd context on either side. A last call without a batch
hands in the final gradient, before the trainer evaluates or leaves; a trainer that dies in
between contributes nothing for that step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from psserver.ps.protocols.base import StepProtocol, register
from psserver.ps.protocols.trainer_compute import TrainerComputeHalf, TrainerComputeServer


class PushPullServer(TrainerComputeServer):
    ops = ("exchange", "parameters")

    def exchange(self, trainer: str, grads: list[torch.Tensor] | None, samples: int | None,
                 norm: float | None = None) -> list[torch.Tensor] | None:
        """Apply ``grads`` (the flat gradient of ``trainer``'s open step; None: none owed), then
        return the flat parameters for its next step of ``samples`` (None: it is done). With
        several server processes ``grads`` is this server's partition and ``norm`` the whole
        gradient's norm."""
        if norm is not None and not isinstance(norm, float):
            raise ValueError(f"gradient norm must be a float, got {type(norm).__name__}")
        return self.finish_then_start(trainer, lambda: grads is not None and self._push(trainer, grads, norm),
                                      None if samples is None else lambda: self._pull(trainer, samples))

    def _push(self, trainer: str, grads: list[torch.Tensor], norm: float | None) -> None:
        try:
            unflat = self.engine.grads_from_flat(grads)
        except BaseException:
            self.engine.drop_step(trainer)
            raise
        self.engine.submit(trainer, unflat, norm)

    def _pull(self, trainer: str, samples: int) -> list[torch.Tensor]:
        self.engine.open_step(trainer, samples)
        return self.engine.flat_parameters(self.wire_dtype(trainer))


class PushPullTrainer(TrainerComputeHalf):
    def __init__(self, channel) -> None:
        super().__init__(channel)
        self._grads: list[list[torch.Tensor]] | None = None  # owed to the server(s): one list per server

    def _exchange(self, grads: list[list[torch.Tensor]] | None, samples: int | None) -> list | None:
        """One ``exchange`` per server process, all in flight at once; their replies in order."""
        if self.plan is None:
            return [self.channel.call("exchange", None if grads is None else grads[0], samples)]
        norm = None if grads is None else self.norm_of(grads)
        return self.channel.call_each("exchange", [(None if grads is None else g, samples, norm) for g in
                                                   (grads or [None] * len(self.channel.servers))])

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        grads, self._grads = self._grads, None  # sent once, whatever the call's fate
        self.load(self._exchange(grads, int(x.shape[0])))
        loss = F.cross_entropy(self.model(x), y)
        self._grads = self.flat_grads(list(torch.autograd.grad(loss, self.params, allow_unused=True)))
        return float(loss.detach())

    def flush(self) -> None:
        grads, self._grads = self._grads, None
        if grads is not None:
            self._exchange(grads, None)


PROTOCOL = register(StepProtocol("pushpull", PushPullTrainer, PushPullServer))
