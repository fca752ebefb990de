"""The server's RPC surface: the functions a trainer names in its calls, thin, and the one
module-level slot they forward to.

RPC pickles a call as its function's module and name plus the arguments, so both sides must
import the same functions; they live here, apart from the server's handler
(``psserver.server.endpoint.Endpoint``), which a server process installs (:func:`install`):
a trainer imports this module and nothing of the server (ps-lite's transport apart from the
handler that applies updates). The RPC allow-list (``rpc_allowlist``) names these.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, Protocol

from torch import nn

from psserver.common import torch_rpc
from psserver.common.messages import JoinRequest, Report
from psserver.common.rpc_allowlist import is_optimizer_class

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

NOT_A_MEMBER = "NOT_A_MEMBER"
"""What :func:`heartbeat` answers a trainer that is not a member (evicted, or never joined)."""


Progress = tuple[int, float | None, int]
"""What every call's reply says besides its result: the global step, the learning rate of the
next update (None: the server holds no model yet) and the staleness of the caller's last update."""


class Handler(Protocol):
    """What a server process installs behind these functions (its endpoint)."""

    halves: Mapping[str, Any]

    def join(self, request: JoinRequest) -> dict[str, Any]: ...
    def call(self, trainer: str, op: str, args: tuple, report: Report | None) -> tuple[Any, list[str], Progress]: ...
    def heartbeat(self, trainer: str, report: Report | None) -> str: ...
    def leave(self, trainer: str, report: Report | None) -> None: ...
    def host_trainers(self, trainer: str) -> int: ...
    def call_local(self, trainer: str, op: str, *args: Any) -> Any: ...
    def trainer_of_context(self, context_id: int) -> str: ...


_current: Handler | None = None


def install(handler: Handler | None) -> None:
    global _current
    _current = handler


def current() -> Handler:
    if _current is None:
        raise RuntimeError("no parameter server is running in this process")
    return _current


def _refused_quietly(fn: Callable) -> Callable:
    """What a peer's call raises goes back to it as the error torch would send, without the
    traceback torch prints on this side for every failed call: a peer sending malformed
    arguments each step would fill the server's log. One line here (at the exception's
    ``log_level``, WARNING by default); the traceback at DEBUG."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            from torch.distributed.rpc.internal import RemoteException

            text = str(e).strip().splitlines()
            log.log(getattr(e, "log_level", logging.WARNING), "a call to %s failed: %s%s", fn.__name__,
                    type(e).__name__, f": {text[0]}" if text else "")
            log.debug("the failed call to %s", fn.__name__, exc_info=True)
            return RemoteException(f"On {torch_rpc.worker_info_or_name()}:\n{e!r}\n", type(e))

    return run


@_refused_quietly
def join(request: JoinRequest) -> dict[str, Any]:
    return current().join(request)


@_refused_quietly
def call(trainer: str, op: str, args: tuple, report: Report | None) -> tuple[Any, list[str], Progress]:
    return current().call(trainer, op, args, report)


@_refused_quietly
def heartbeat(trainer: str, report: Report | None) -> str:
    return current().heartbeat(trainer, report)


@_refused_quietly
def leave(trainer: str, report: Report | None) -> None:
    current().leave(trainer, report)


@_refused_quietly
def host_trainers(trainer: str) -> int:
    return current().host_trainers(trainer)


class SharedOptimizer:
    """The local optimizer ``DistributedOptimizer`` builds on the server (``_LocalOptimizer``):
    a handle, no state. torch's RPC calls it, so it belongs to the RPC surface.

    ``--step plain`` builds it for its trainer by name. A user's own ``DistributedOptimizer``
    (the RPC tutorial's loop, ``Connection.parameter_rrefs``) names a ``torch.optim`` class,
    which must be the server's (:func:`new_local_optimizer`); it builds this handle instead,
    for no trainer in particular, so
    that every trainer's step goes through the server's one shared optimizer. Its steps arrive
    through :func:`local_optimizer_step`, which finds the trainer from the step's autograd
    context (torch numbers contexts by the worker that created them) and hands the gradient
    to the protocol's ``submit``, counted like every call."""

    def __init__(self, params: list[nn.Parameter], trainer: str | None = None,
                 requested: str | None = None) -> None:
        self.params = params
        self.trainer = trainer
        self.requested = requested
        """The optimizer the user's ``DistributedOptimizer`` named (the server's)."""
        self.param_groups = [{"params": params}]
        self.state: dict = {}
        self._mine = {id(p) for p in params}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    def step(self, closure=None) -> None:
        raise RuntimeError("psserver's shared optimizer steps through DistributedOptimizer.step(context_id)")

    def submit(self, context_id: int) -> None:
        """The gradient of ``context_id`` (this server's parameters) as its trainer's step."""
        grads = {p: g for p, g in torch_rpc.autograd_gradients(context_id).items() if id(p) in self._mine}
        endpoint = current()
        trainer = self.trainer if self.trainer is not None else endpoint.trainer_of_context(context_id)
        endpoint.call_local(trainer, "submit", grads)  # the guard's notices ride on its next call


@_refused_quietly
def new_local_optimizer(optim_cls: type, local_params_rref: list, *args: Any, **kwargs: Any) -> Any:
    """``torch.distributed.optim``'s ``_new_local_optimizer`` as the server runs it: the
    :class:`SharedOptimizer` handle, once the ``torch.optim`` optimizer the caller named is the
    server's (it sets a server that has none set; another is refused)."""
    if optim_cls is SharedOptimizer:
        return torch_rpc.new_local_optimizer(SharedOptimizer, local_params_rref, *args, **kwargs)
    if not is_optimizer_class(optim_cls):
        raise ValueError(f"DistributedOptimizer names {optim_cls!r}, not a torch.optim optimizer")
    # The server's optimizer, as the trainer named it (else ValueError: the step half decides).
    requested = current().halves["plain"].agree_named_optimizer(optim_cls, args, kwargs)  # type: ignore[attr-defined]
    return torch_rpc.new_local_optimizer(SharedOptimizer, local_params_rref, requested=requested)


@_refused_quietly
def local_optimizer_step(local_optim_rref: Any, autograd_ctx_id: int) -> None:
    """``torch.distributed.optim``'s ``_local_optimizer_step`` as the server runs it."""
    optimizer = torch_rpc.local_optimizer_of(local_optim_rref)
    if not isinstance(optimizer, SharedOptimizer):
        raise ValueError("psserver steps only its shared optimizer")
    optimizer.submit(int(autograd_ctx_id))
