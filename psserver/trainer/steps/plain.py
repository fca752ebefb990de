"""The trainer half of ``--step plain``: forward on the server inside a ``dist_autograd`` context,
the loss here, ``dist_autograd.backward`` and ``DistributedOptimizer.step`` through the
server's shared optimizer.

The protocol, its order of work and why: its server half, ``psserver.server.steps.plain``.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed.autograd as dist_autograd

from psserver.common.calls import SharedOptimizer
from psserver.trainer.steps.base import TrainerHalf, register

log = logging.getLogger(__name__)



class _NoFunctionalOptimizerWarning(logging.Filter):
    """DistributedOptimizer warns on every construction that SharedOptimizer has no
    TorchScript twin: true, and irrelevant (it only hands the gradient over)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.args and SharedOptimizer in record.args)  # type: ignore[operator]


logging.getLogger("torch.distributed.optim.optimizer").addFilter(_NoFunctionalOptimizerWarning())



class PlainTrainer(TrainerHalf):
    def __init__(self, channel) -> None:
        super().__init__(channel)
        # Here, not at the top: torch.distributed.optim imports FSDP, DTensor and sympy (0.6 s
        # of every psserver process's start, though only --step plain uses it).
        from torch.distributed.optim import DistributedOptimizer

        self.optimizer: DistributedOptimizer | None = DistributedOptimizer(
            SharedOptimizer, channel.info["param_rrefs"], trainer=channel.name)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        assert self.optimizer is not None
        with dist_autograd.context() as ctx:
            out = self.channel.call("forward", x)
            loss = self.channel.loss_fn(out, y)
            dist_autograd.backward(ctx, [loss])
            self.optimizer.step(ctx)
        return float(loss.detach())

    def close(self) -> None:
        self.optimizer = None


register('plain', PlainTrainer)
