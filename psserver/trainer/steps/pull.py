"""The trainer half of ``--step pull``: the parameters pulled inside a ``dist_autograd`` context,
forward and backward on this trainer's device, the gradients delivered by
``dist_autograd.backward`` and applied through the server's shared optimizer.

The protocol, its order of work and why: its server half, ``psserver.server.steps.pull``.
"""

from __future__ import annotations

import torch
import torch.distributed.autograd as dist_autograd
from torch.func import functional_call

from psserver.common.tensors import unflatten_into
from psserver.models.calling import input_batch_size, model_arguments
from psserver.trainer.compute.rows import RowBatch
from psserver.trainer.steps.base import register
from psserver.trainer.steps.plain import PlainTrainer
from psserver.trainer.steps.trainer_compute import TrainerComputeHalf


class PullTrainer(TrainerComputeHalf, PlainTrainer):
    _owed: torch.Tensor | None = None
    """The replica's buffers after its last step, for the server (``psserver.common.tensors``)."""

    def train_step(self, x, y: torch.Tensor) -> float:
        assert self.optimizer is not None
        batch = None if self.table_columns is None else RowBatch(x[0], self.table_columns, 1)
        owed, self._owed = self._owed, None
        with dist_autograd.context() as ctx:
            samples = input_batch_size(x) if batch is None else int(y.shape[0])
            got = self.channel.call("pull", samples, None if batch is None else batch.requests[0], owed)
            if self.buffers:
                unflatten_into(got[-1], self.buffers)
                got = got[:-1]
            params, rows = got[:len(self.params)], got[len(self.params):]
            # Local copies (device, fp32) stay in the graph: their gradients go back in the wire dtype.
            local = dict(zip(self.names, [p.to(self.device, torch.float32) for p in params], strict=True))
            if batch is None:
                args, kwargs = model_arguments(x)
                loss = self.loss_fn(functional_call(self.model, local, args, kwargs), y)
            else:
                per_sample = batch.per_sample([r.to(self.device, torch.float32) for r in rows])
                out = functional_call(self.model, local, (per_sample, x[1]))
                loss = self.loss_fn(out, y) + self.model.penalty(per_sample)
            dist_autograd.backward(ctx, [loss])
            self.optimizer.step(ctx)
        self._owed = self.owed_buffers()
        return float(loss.detach())

    def flush(self) -> None:
        owed, self._owed = self._owed, None
        if owed is not None:
            self.channel.call("push_buffers", owed)


register('pull', PullTrainer)
