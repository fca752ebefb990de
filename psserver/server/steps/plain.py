"""``--step plain``: the reference protocol, three round trips, torch's distributed API end to end.

Trainer: inside ``dist_autograd.context()``, ``rpc_sync(forward)`` (the batch goes, the
server runs the model, the output comes back tied to the server's graph), the loss on the
trainer, ``dist_autograd.backward`` (the output's gradient goes back, the server runs its part
of the backward into the context) and ``DistributedOptimizer.step`` (the server applies the
gradient it holds).

``DistributedOptimizer`` builds one local optimizer per trainer on the parameters' owner, so
with N trainers Adam would keep N sets of moments. Its local optimizer here is the
:class:`~psserver.common.calls.SharedOptimizer`: a handle that passes the trainer's
complete gradient to ``submit`` below, and so to the engine, whose one optimizer per shard
every trainer shares. The optimizer a user's ``DistributedOptimizer`` names must be that one:
it sets a server that has none set, another is refused (:meth:`PlainServer.agree_named_optimizer`).
"""

from __future__ import annotations

import logging
import threading

import torch
import torch.distributed.rpc as rpc
from torch import nn

from psserver.common import torch_rpc
from psserver.common.rpc_allowlist import is_optimizer_class
from psserver.config import OptimizerConfig
from psserver.errors import UserCodeError
from psserver.server.steps.base import ServerHalf, register
from psserver.utils.divergence import GrowthWatch

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
        self._outputs = GrowthWatch()

    def join_info(self, trainer: str, request) -> dict:
        with self._lock:
            if self._rrefs is None:
                self._rrefs = [rpc.RRef(p) for p in self.engine.params]
            return {"param_rrefs": self._rrefs}

    def forward(self, trainer: str, x: torch.Tensor, training: bool = True) -> torch.Tensor:
        """The model on ``x`` for a step (its backward reaches the server), or with ``training``
        False for an evaluation (the trainer called it under ``no_grad`` or outside a
        ``dist_autograd`` context, where no backward can come): no step, no graph kept."""
        if training is False:
            self.engine.wait_applied(trainer)
            with torch.no_grad():
                return self.engine.forward(x, clone=False).to("cpu")
        ctx = torch_rpc.current_autograd_context_id()
        self.engine.wait_turn(trainer)
        with self._lock:
            kept = self._contexts.setdefault(trainer, [])
            kept.append(ctx)
            del kept[:-_CONTEXTS_KEPT]
        self.engine.open_step(trainer, int(x.shape[0]))
        try:
            # On this RPC thread, not the compute thread: dist_autograd runs the backward on
            # threads of its own anyway (psserver.server.engine.compute); a hand-off only adds latency.
            out = self.engine.forward(x, clone=self.engine.needs_clone()).to("cpu")
        except BaseException:
            self.engine.drop_step(trainer)
            raise
        self._watch(out)
        return out

    def _watch(self, out: torch.Tensor) -> None:
        """Tell once when the model's outputs grow by orders of magnitude: the trainer's loss,
        which would show it, never reaches this server."""
        if not isinstance(out, torch.Tensor) or not out.is_floating_point() or not out.numel():
            return
        largest = float(out.detach().abs().amax())
        with self._lock:
            diverging = self._outputs.observe(largest)
        if diverging:
            log.warning("the largest of the model's outputs is %s (global step %d)", diverging,
                        self.engine.global_step)

    def submit(self, trainer: str, grads: dict[nn.Parameter, torch.Tensor]) -> None:
        """The trainer's whole gradient, from :meth:`SharedOptimizer.step` on an RPC thread."""
        self.engine.submit(trainer, grads)

    def agree_named_optimizer(self, optim_cls: type, args: tuple, kwargs: dict) -> str:
        """The optimizer a user's own ``DistributedOptimizer`` names (the RPC tutorial's loop), as
        ``ps.replica(model, optimizer=...)`` names one: it sets a server that has none set (no
        ``--optimizer``, no trainer's choice, no update yet); it is the server's, or it is
        refused (``ValueError``): its steps would otherwise run an optimizer it never named."""
        engine = self.engine
        requested = named_optimizer(optim_cls, args, kwargs)
        try:
            chosen = engine.agree_optimizer(requested, "a trainer's DistributedOptimizer", replaces_default=True)
        except UserCodeError as e:  # --lr-schedule cannot take it
            raise ValueError(f"DistributedOptimizer names {requested.describe()}: {e}") from None
        except ValueError:
            current = engine.optimizer_config
            assert current is not None
            if engine.optimizer_defaulted:
                why = (f"its default, which {engine.global_step} updates have used: name it, or name yours before "
                       "any step")
            else:
                why = ("psserver serve --optimizer/--lr, or the first trainer's choice: name it, or start psserver "
                       "serve without --optimizer for the first trainer's to apply")
            msg = (f"DistributedOptimizer names {requested.describe()}, but this server trains with "
                   f"{current.describe()} ({why})")
            log.warning("refused a trainer's %s", msg)
            raise ValueError(msg) from None
        return chosen.describe()

    def trainer_gone(self, trainer: str, evicted: bool) -> None:
        with self._lock:
            contexts = self._contexts.pop(trainer, [])
        if evicted:  # a live trainer releases its own contexts as it leaves them
            for ctx in contexts:
                torch_rpc.release_autograd_context(ctx)

    def close(self) -> None:
        with self._lock:
            self._rrefs = None



def named_optimizer(optim_cls: type, args: tuple, kwargs: dict) -> OptimizerConfig:
    """The configuration of ``optim_cls(params, *args, **kwargs)`` (a ``torch.optim`` class or
    the functional twin ``DistributedOptimizer`` sends for it): built once over a stand-in
    parameter and read back as ``ps.replica``'s optimizer is (``OptimizerConfig.from_optimizer``),
    so that defaults and implementation flags (``foreach``, ``fused``) compare as there.
    ``ValueError`` for arguments the class refuses."""
    from torch.distributed.optim.utils import functional_optim_map

    cls = {f: c for c, f in functional_optim_map.items()}.get(optim_cls, optim_cls)
    name = getattr(cls, "__name__", repr(cls))
    if not is_optimizer_class(cls) or getattr(torch.optim, name, None) is not cls:
        raise ValueError(f"DistributedOptimizer names {name}: psserver's server runs torch.optim optimizers only")
    try:
        return OptimizerConfig.from_optimizer(cls([torch.zeros(1, requires_grad=True)], *args, **kwargs))
    except Exception as e:  # noqa: BLE001 - whatever the class raises refuses its arguments
        raise ValueError(f"DistributedOptimizer names {name} with arguments it refuses: {e}") from None


register('plain', PlainServer)
