"""``--step plain``: the reference protocol, three round trips, torch's distributed API end to end.

Trainer: inside ``dist_autograd.context()``, ``rpc_sync(forward)`` (the batch goes, the
server runs the model, the output comes back tied to the server's graph), the loss on the
trainer, ``dist_autograd.backward`` (the output's gradient goes back, the server runs its part
of the backward into the context) and ``DistributedOptimizer.step`` (the server applies the
gradient it holds).

``DistributedOptimizer`` builds one local optimizer per trainer on the parameters' owner, so
with N trainers Adam would keep N sets of moments. Its local optimizer here is the
endpoint's :class:`~psserver.ps.server.endpoint.SharedOptimizer`: a handle that passes the trainer's
complete gradient to ``submit`` below, and so to the engine, whose one optimizer per shard
every trainer shares.
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

from psserver.ps.protocols.base import ServerHalf, StepProtocol, TrainerHalf, register
from psserver.ps.rpc import torch_rpc
from psserver.ps.server.endpoint import SharedOptimizer

log = logging.getLogger(__name__)

_CONTEXTS_KEPT = 4  # a trainer has one context open at a time; a few more cover stragglers


class PlainServer(ServerHalf):
    ops = ("forward",)
    local_ops = ("submit",)

    def __init__(self, engine) -> None:
        super().__init__(engine)
        self._lock = threading.Lock()
        self._rrefs: list[rpc.RRef] | None = None
        self._contexts: dict[str, list[int]] = {}  # trainer -> autograd contexts it opened here

    def join_info(self, trainer: str, request) -> dict:
        with self._lock:
            if self._rrefs is None:
                self._rrefs = [rpc.RRef(p) for p in self.engine.params]
            return {"param_rrefs": self._rrefs}

    def forward(self, trainer: str, x: torch.Tensor) -> torch.Tensor:
        ctx = torch_rpc.current_autograd_context_id()
        if ctx is None:  # outside dist_autograd.context() no backward reaches here: an evaluation, not a step
            self.engine.wait_applied(trainer)
            with torch.no_grad():
                return self.engine.forward(x, clone=False).to("cpu")
        self.engine.wait_turn(trainer)
        with self._lock:
            kept = self._contexts.setdefault(trainer, [])
            kept.append(ctx)
            del kept[:-_CONTEXTS_KEPT]
        self.engine.open_step(trainer, int(x.shape[0]))
        try:
            # On this RPC thread, not the compute thread: dist_autograd runs the backward on
            # threads of its own anyway (psserver.ps.engine.compute); a hand-off only adds latency.
            return self.engine.forward(x, clone=self.engine.needs_clone()).to("cpu")
        except BaseException:
            self.engine.drop_step(trainer)
            raise

    def submit(self, trainer: str, grads: dict[nn.Parameter, torch.Tensor]) -> None:
        """The trainer's whole gradient, from :meth:`SharedOptimizer.step` on an RPC thread."""
        self.engine.submit(trainer, grads)

    def trainer_gone(self, trainer: str, evicted: bool) -> None:
        with self._lock:
            contexts = self._contexts.pop(trainer, [])
        if evicted:  # a live trainer releases its own contexts as it leaves them
            for ctx in contexts:
                torch_rpc.release_autograd_context(ctx)

    def close(self) -> None:
        with self._lock:
            self._rrefs = None


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


PROTOCOL = register(StepProtocol("plain", PlainTrainer, PlainServer))
