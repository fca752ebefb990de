"""``--step pull``: trainer compute, the reference protocol, torch's distributed API end to end.

Inside ``dist_autograd.context()`` the trainer pulls the parameters with one RPC whose
results are the server's parameter tensors (in the wire dtype), so the copies the trainer
receives stay tied to them: it runs forward and backward on its own device,
``dist_autograd.backward`` delivers the parameters' gradients to the server, and
``DistributedOptimizer.step`` applies them there through the shared optimizer
(``SharedOptimizer``, as ``--step plain``). Three round trips per step.
"""

from __future__ import annotations

import torch
import torch.distributed.autograd as dist_autograd
import torch.nn.functional as F
from torch.func import functional_call

from psserver.ps.protocols.base import StepProtocol, register
from psserver.ps.protocols.plain import PlainServer, PlainTrainer
from psserver.ps.protocols.trainer_compute import TrainerComputeHalf, TrainerComputeServer


class PullServer(TrainerComputeServer, PlainServer):
    ops = ("pull", "parameters")

    def pull(self, trainer: str, samples: int) -> list[torch.Tensor]:
        """The parameters for a step of ``samples``, tied to the server's by autograd."""
        self.engine.wait_turn(trainer)
        self.engine.open_step(trainer, samples)
        return self.engine.parameters(clone=self.engine.needs_clone(), dtype=self.wire_dtype(trainer))


class PullTrainer(TrainerComputeHalf, PlainTrainer):
    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        assert self.optimizer is not None
        with dist_autograd.context() as ctx:
            params = self.channel.call("pull", int(x.shape[0]))
            # Local copies (device, fp32) stay in the graph: their gradients go back in the wire dtype.
            local = [p.to(self.device, torch.float32) for p in params]
            out = functional_call(self.model, dict(zip(self.names, local, strict=True)), (x,))
            loss = F.cross_entropy(out, y)
            dist_autograd.backward(ctx, [loss])
            self.optimizer.step(ctx)
        return float(loss.detach())


PROTOCOL = register(StepProtocol("pull", PullTrainer, PullServer))
