"""PyTorch's RPC tutorial's way to step: :class:`RemoteModel`, the server's model that
``ps.parameter_rrefs()`` joined for (``step='plain'``). The trainer builds none of the model's
code: it holds RRefs to the server's parameters for a ``torch.distributed.optim.
DistributedOptimizer`` of its own, runs :meth:`RemoteModel.forward` on the server inside a
``dist_autograd`` context, and steps with that optimizer's ``step(ctx)``.

Its calls go through the connection (``psserver.trainer.connection``), which keeps the
membership: a failed call recovered (``_call``), each training forward counted as a step
(``_count_step``), a signal left on at the step boundary. The :class:`Connection`'s own
``parameter_rrefs`` and ``forward`` are this object's (:attr:`Connection.stepping`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from psserver.common import torch_rpc
from psserver.config import TrainerConfig
from psserver.errors import UsageError
from psserver.models.calling import input_batch_size
from psserver.trainer.membership import Membership

if TYPE_CHECKING:
    from psserver.trainer.session import Session


def remote_config(config: TrainerConfig) -> TrainerConfig:
    """The connection's config for the RPC tutorial's join: ``step='plain'``, the server computes."""
    if config.step not in (None, "plain"):
        raise UsageError(f"ps.parameter_rrefs speaks step='plain'; this connection asked for {config.step!r}")
    return dataclasses.replace(config, step="plain", compute=None)


class RemoteModel:
    """The server's model, for PyTorch's RPC tutorial loop (``ps.parameter_rrefs()``,
    ``ps.forward(x)``): made by the connection once it joined with ``step='plain'``."""

    def __init__(self, ps: Membership, session: Session) -> None:
        self._ps = ps
        self._session = session

    def parameter_rrefs(self) -> list[torch.distributed.rpc.RRef]:
        """RRefs to the server's parameters, for PyTorch's RPC tutorial loop: ``with
        dist_autograd.context() as ctx``, ``out = ps.forward(x)``, ``dist_autograd.backward(ctx,
        [loss])``, and a ``torch.distributed.optim.DistributedOptimizer`` over these RRefs whose
        ``step(ctx)`` goes through the server's one shared optimizer: the one it names sets a
        server started without ``--optimizer``, another than the server's is refused (a
        ``ValueError`` from its constructor). The server must hold the model's code
        (``psserver serve --model``), since it runs the forward."""
        return list(self._session.info["param_rrefs"])

    def forward(self, x: Any) -> torch.Tensor:
        """The server's model on ``x`` (the RPC tutorial's remote forward), inside the caller's
        ``dist_autograd`` context: its backward reaches the server's parameters. A forward
        that can train (grad enabled, inside a context) is a step; any other (an evaluation)
        opens no step on the server and counts none here."""
        self._ps.leave_on_signal()  # the step before ended with its optimizer's step(ctx)
        training = torch.is_grad_enabled() and torch_rpc.current_autograd_context_id() is not None
        session = self._session
        out = self._ps._call(lambda: session.call("forward", x, training))
        if training:
            self._ps._count_step(input_batch_size(x), None)
        return out

    def __repr__(self) -> str:
        return f"<psserver RemoteModel, the server's model for {self._session.name}>"
