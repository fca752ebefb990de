"""The optimizer class trainers hand to ``DistributedOptimizer``.

``DistributedOptimizer`` builds one local optimizer per trainer on the parameter owner, so
with N trainers and Adam there would be N sets of moments. ``SharedOptimizer`` is that local
optimizer: a thin handle that passes the trainer's complete gradient to the server's updater,
which steps the one optimizer per shard that all trainers share.
"""

from __future__ import annotations

import torch
from torch import nn


class SharedOptimizer:
    """Built on the server by ``DistributedOptimizer`` (``_LocalOptimizer``), one per trainer."""

    def __init__(self, params: list[nn.Parameter], trainer: str) -> None:
        from psserver.ps.server import current_server

        self.params = params
        self.trainer = trainer
        self.server = current_server()
        self.param_groups = [{"params": params}]
        self.state: dict = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self, closure=None) -> None:
        # _LocalOptimizer has put this trainer's gradients from its autograd context into
        # .grad (under its global lock); take them out before another trainer's step does.
        grads = {p: p.grad for p in self.params if p.grad is not None}
        for p in self.params:
            p.grad = None
        self.server.submit(self.trainer, grads)
