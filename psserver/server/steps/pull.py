"""``--step pull``: trainer compute, the reference protocol, torch's distributed API end to end.

Inside ``dist_autograd.context()`` the trainer pulls the parameters with one RPC whose
results are the server's parameter tensors (in the wire dtype), so the copies the trainer
receives stay tied to them: it runs forward and backward on its own device,
``dist_autograd.backward`` delivers the parameters' gradients to the server, and
``DistributedOptimizer.step`` applies them there through the shared optimizer
(``SharedOptimizer``, as ``--step plain``). Three round trips per step.

A model with embedding tables pulls its batch's rows in the same call: the server returns
each table's rows as a leaf of its own autograd graph, so ``dist_autograd.backward`` carries
the rows' gradients back into the server's context, where the step's ``submit`` takes them
(as rows, the ids served) beside the dense ones.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed.autograd as dist_autograd
from torch import nn

from psserver.common import torch_rpc
from psserver.server.engine.engine import check_samples
from psserver.server.steps.base import register
from psserver.server.steps.plain import PlainServer
from psserver.server.steps.trainer_compute import TrainerComputeServer


class PullServer(TrainerComputeServer, PlainServer):
    ops = ("pull", "parameters", "rows", "push_buffers")

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._row_lock = threading.Lock()
        self._row_steps: dict[str, tuple[int | None, dict[str, torch.Tensor]]] = {}  # trainer -> (context, leaves)

    def pull(self, trainer: str, samples: int, ids: object = None, buffers: object = None) -> list[torch.Tensor]:
        """The parameters for a step of ``samples``, tied to the server's by autograd; with
        embedding tables, then the rows of ``ids`` (``{table: unique ids}``), one tensor per table;
        with the model's buffers, last, the server's. ``buffers``: the trainer's after its last
        step's forward (they reach the server one call after that step's gradient, and count from
        the next update on)."""
        check_samples(samples)
        flat = self.check_buffers(buffers)
        if flat is not None:
            self.engine.buffers.receive(trainer, flat)
        tables = self.engine.tables
        if (tables is None) != (ids is None):
            raise ValueError(f"model {self.engine.config.model} has no embedding tables" if tables is None else
                             f"model {self.engine.config.model} keeps embedding tables: a pull carries the batch's ids")
        self.engine.wait_turn(trainer)
        rows = tables.serve(trainer, ids) if tables is not None else None  # a bad request opens no step
        self.engine.open_step(trainer, samples)
        wire = self.wire_dtype(trainer)
        params = self.engine.parameters(clone=self.engine.needs_clone(), dtype=wire)
        if rows is not None:
            leaves = {name: r.requires_grad_() for name, r in rows.items()}
            with self._row_lock:
                self._row_steps[trainer] = (torch_rpc.current_autograd_context_id(), leaves)
            params = params + [leaf.view_as(leaf).to(wire) for leaf in leaves.values()]
        return self.with_buffers(params)

    def push_buffers(self, trainer: str, buffers: object) -> None:
        """The trainer's buffers after its last step (before it evaluates or leaves), kept now."""
        flat = self.check_buffers(buffers)
        if flat is not None and self.engine.buffers.receive(trainer, flat):
            with self.engine.updater.lock:
                self.engine.buffers.commit()

    def submit(self, trainer: str, grads: dict[nn.Parameter, torch.Tensor]) -> None:
        """The trainer's whole gradient: the dense part from ``SharedOptimizer``, the rows' from
        the step's autograd context."""
        tables = self.engine.tables
        if tables is not None:
            with self._row_lock:
                ctx, leaves = self._row_steps.pop(trainer, (None, {}))
            try:
                got = dist_autograd.get_gradients(ctx) if ctx is not None else {}
                rows = {name: got.get(leaf, torch.zeros_like(leaf)) for name, leaf in leaves.items()}
                grads = {**grads, **tables.row_grads(trainer, rows)}
            except BaseException:
                self.engine.drop_step(trainer)
                raise
        self.engine.submit(trainer, grads)

    def trainer_gone(self, trainer: str, evicted: bool) -> None:
        with self._row_lock:
            self._row_steps.pop(trainer, None)
        super().trainer_gone(trainer, evicted)


register('pull', PullServer)
