"""``--step pull``: the trainer runs the model; the server holds the parameters and applies gradients.

Inside ``dist_autograd.context()`` the trainer pulls the parameters with one RPC whose
results are the server's parameter tensors themselves, so the copies the trainer receives
stay tied to them: it runs forward and backward on its own device, ``dist_autograd.backward``
delivers the parameters' gradients to the server, and ``DistributedOptimizer.step`` applies
them there through the shared optimizer (``SharedOptimizer``, as ``--step plain``).
"""

from __future__ import annotations

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch.func import functional_call

from psserver.models import build_model
from psserver.ps.protocols.base import StepProtocol, register
from psserver.ps.protocols.plain import PlainServer, PlainTrainer


class PullServer(PlainServer):
    ops = ("pull",)

    def pull(self, trainer: str, samples: int) -> list[torch.Tensor]:
        """The parameters for a step of ``samples``, tied to the server's by autograd."""
        self.engine.wait_turn(trainer)
        self.engine.open_step(trainer, samples)
        return self.engine.parameters(clone=self.engine.needs_clone())


class PullTrainer(PlainTrainer):
    def __init__(self, channel) -> None:
        super().__init__(channel)
        self.model = build_model(channel.info["model"])
        self.names = [n for n, _ in self.model.named_parameters()]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        assert self.optimizer is not None
        with dist_autograd.context() as ctx:
            params = self.channel.call("pull", int(x.shape[0]))
            out = functional_call(self.model, dict(zip(self.names, params, strict=True)), (x,))
            loss = F.cross_entropy(out, y)
            dist_autograd.backward(ctx, [loss])
            self.optimizer.step(ctx)
        return float(loss.detach())


PROTOCOL = register(StepProtocol("pull", PullTrainer, PullServer))
