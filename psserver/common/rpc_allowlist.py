"""What the RPC layer of a psserver process unpickles: psserver's RPC surface and the torch
plumbing under it, nothing else.

``torch.distributed.rpc`` sends a Python call as a pickle that names its function, and the
receiver unpickles whatever a pickle names: anyone who can join the RPC group (the rendezvous
store listens on the network) could have the server or a trainer run ``os.system``,
``builtins.exec`` or ``open(...).write``. So every global an incoming message names (the
function of a call, the classes of its arguments, a reply's contents, the type of a remote
exception) goes through :func:`find_global` (``psserver.common.torch_rpc.restrict_unpickler``
installs it):

- ``ALLOWED``: explicit ``(module, name)`` pairs, what psserver and torch's RPC plumbing send
  (read in torch 2.14, and checked against every message the end-to-end tests exchange);
- families checked by kind, without importing anything: the dataclasses of
  ``MESSAGE_MODULES``, torch's dtype, layout and memory-format constants, and exception
  classes of modules already imported (a remote exception names its type; only building it
  from its message is what the caller does with it);
- the ``torch.optim`` optimizer classes and their functional twins, which a
  ``DistributedOptimizer`` names (the server never instantiates them: ``REPLACED``);
- ``builtins.getattr``, which the RPC pickler uses to name its own receivers (a tensor of the
  message's tensor table, an RRef), comes back as :func:`rpc_getattr`, which gives only those.

Anything else raises :class:`RefusedCall` while the message is read: the call fails with an
error reply to its caller and nothing of it ran. Refusals are counted by name
(:func:`refused_counts`, ``psserver_rpc_refusals_total``) and logged at most 5 lines a minute.

Refused on purpose, though torch could send them: ``torch.storage._load_from_bytes`` (it is
``torch.load(weights_only=False)``, a pickle of the caller's choosing; the RPC pickler sends
tensors out of band, never as storages) and the tensor rebuild functions that need it; the
pickler's ``_script_module_receiver`` (``torch.jit.load`` of the caller's bytes); RRef proxies
(``rref_proxy._local_invoke`` calls any method, by name, of an object the receiver owns);
static-group plumbing (psserver's groups are dynamic); the public helpers of the endpoint that
are not its RPC surface (``install(None)`` would unplug it).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import pickle
import sys
import types
from typing import Any

import torch

from psserver.telemetry import RPC_REFUSALS

log = logging.getLogger(__name__)

_CALLS = "psserver.common.calls"
_INTERNAL = "torch.distributed.rpc.internal"
_OPTIM = "torch.distributed.optim.optimizer"

ALLOWED: frozenset[tuple[str, str]] = frozenset({
    # psserver's RPC surface: what a trainer calls on the server (psserver.trainer.loop), ...
    (_CALLS, "join"), (_CALLS, "call"), (_CALLS, "heartbeat"), (_CALLS, "leave"),
    (_CALLS, "host_trainers"),
    # ... the local optimizer that DistributedOptimizer has the server build (--step plain, pull), ...
    (_CALLS, "SharedOptimizer"),
    # ... and what the server calls on a trainer (Membership.admit); server processes call
    # each other through one function (psserver.server.group.peers).
    ("psserver.common.rendezvous", "ping"), ("psserver.server.group.peers", "server_call"),
    # torch's RPC plumbing: the envelopes of a call and of a remote exception; the pickler's
    # class (its receivers, through rpc_getattr); a dynamic group's device infos (its join and
    # leave: REPLACED); DistributedOptimizer's two calls; the type of an RRef's value, asked of
    # its owner (RRef._get_type).
    (_INTERNAL, "PythonUDF"), (_INTERNAL, "RemoteException"), (_INTERNAL, "_InternalRPCPickler"),
    ("torch._C._distributed_rpc", "WorkerInfo"),
    ("torch.distributed.rpc.backend_registry", "_get_device_infos"),
    ("torch.distributed.rpc.api", "_rref_typeof_on_owner"),
    # Data: a parameter (its tensor rides in the tensor table), devices (of a group's device
    # maps), sizes, ordered dicts. Lists, dicts, tuples, sets, strings and numbers need no global.
    ("torch._utils", "_rebuild_parameter"), ("torch", "device"), ("torch", "Size"), ("collections", "OrderedDict"),
})

REPLACED: dict[tuple[str, str], tuple[str, str]] = {
    # DistributedOptimizer's two calls run as psserver's: whatever torch.optim class a trainer's
    # DistributedOptimizer names, the server builds its shared optimizer's handle, and a step
    # goes through it (psserver.common.calls.SharedOptimizer).
    (_OPTIM, "_new_local_optimizer"): (_CALLS, "new_local_optimizer"),
    (_OPTIM, "_local_optimizer_step"): (_CALLS, "local_optimizer_step"),
    (_OPTIM, "_new_functional_local_optimizer"): (_CALLS, "new_local_optimizer"),
    (_OPTIM, "_functional_local_optimizer_step"): (_CALLS, "local_optimizer_step"),
    # A dynamic group's join and leave (and psserver's evictions, torch_rpc.tell_worker_removed):
    # torch's, then the agent's devices and reply device maps put back (a leave wipes them all).
    ("torch.distributed.rpc._utils", "_update_group_membership"): ("psserver.common.torch_rpc",
                                                                   "update_group_membership"),
}
"""Globals a message names that the server runs as a function of its own instead."""

RECEIVERS: frozenset[tuple[str, str, str]] = frozenset({
    (_INTERNAL, "_InternalRPCPickler", "_tensor_receiver"),  # a tensor, from the message's tensor table
    (_INTERNAL, "_InternalRPCPickler", "_py_rref_receiver"),  # an RRef, from its fork data
})
"""``(module, class, attribute)``: what :func:`rpc_getattr` gives (the pickler pickles its own
receivers, class methods, as ``getattr(class, name)``)."""

MESSAGE_MODULES: frozenset[str] = frozenset({"psserver.common.messages"})
"""Modules whose dataclasses are messages: each one defined there may be sent."""

_TORCH_OPTIM = "torch.optim."
_FUNCTIONAL_OPTIM = "torch.distributed.optim.functional_"
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)
_GETATTR = ("builtins", "getattr")


class RefusedCall(pickle.UnpicklingError):
    """An RPC message named a global outside psserver's RPC surface: nothing of it ran."""


_resolved: dict[tuple[str, str], Any] = {}


def find_global(module: str, name: str) -> Any:
    """The global ``module.name`` that an RPC message names, if psserver's RPC surface has it;
    :class:`RefusedCall` otherwise (after nothing was imported)."""
    key = (module, name)
    if key in ALLOWED:
        return _load(module, name)
    if key in REPLACED:
        return _load(*REPLACED[key])
    if key == _GETATTR:
        return rpc_getattr
    found = _family_member(module, name)
    if found is None:
        raise refuse(f"{module}.{name}")
    return found


def rpc_getattr(obj: Any, name: str) -> Any:
    """``builtins.getattr`` as RPC messages may use it: to name the pickler's receivers, no more."""
    for module, qualname, attr in RECEIVERS:
        if name == attr and obj is _load(module, qualname):
            return getattr(obj, name)
    raise refuse(f"builtins.getattr({_describe(obj)}, {str(name)!r})")


def refused_counts() -> dict[str, int]:
    """Refusals since the process started, by refused name (cut to 100 characters; past 50
    names, the rest count as ``other``)."""
    return RPC_REFUSALS.counts()


def refuse(what: str) -> RefusedCall:
    """Count a refusal of ``what`` and log it (rate-limited); the exception to raise."""
    what = what[:200]
    log_it, suppressed = RPC_REFUSALS.refused(what)
    if log_it:
        if suppressed:
            log.warning("%d more refused RPC messages not logged (rate limit; counted in psserver_rpc_refusals_total)",
                        suppressed)
        # repr: the name is the sender's text, newlines included
        log.warning("refused an RPC message naming %r: not part of psserver's RPC surface (nothing of it ran)", what)
    return RefusedCall(f"psserver refuses RPC messages naming {what!r}: not part of its RPC surface")


def _load(module: str, qualname: str) -> Any:
    """An allowed global (imported as unpickling would)."""
    key = (module, qualname)
    obj = _resolved.get(key)
    if obj is None:
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        _resolved[key] = obj
    return obj


def _family_member(module: str, name: str) -> Any | None:
    """``module.name`` if it is a message dataclass, a torch constant or an exception class of a
    module already imported; None otherwise. Reads module dicts only: no import, no module
    ``__getattr__``."""
    if "." in name:
        return None
    mod = sys.modules.get(module)
    if not isinstance(mod, types.ModuleType):
        return None
    obj = mod.__dict__.get(name)
    if module in MESSAGE_MODULES:
        ok = isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == module
    elif module.startswith((_TORCH_OPTIM, _FUNCTIONAL_OPTIM)):
        ok = is_optimizer_class(obj) and obj.__module__ == module  # never instantiated: REPLACED
    elif module == "torch":
        ok = isinstance(obj, _TORCH_CONSTANTS) or _is_exception(obj)
    else:
        ok = _is_exception(obj)
    return obj if ok else None


def is_optimizer_class(obj: Any) -> bool:
    """A ``torch.optim`` optimizer class, or the functional twin ``DistributedOptimizer`` sends
    in its place (``torch.distributed.optim.functional_*``)."""
    if not isinstance(obj, type):
        return False
    if issubclass(obj, torch.optim.Optimizer):
        return True
    return obj.__module__.startswith(_FUNCTIONAL_OPTIM) and obj.__name__.startswith("_Functional")


def _is_exception(obj: Any) -> bool:
    # Exception, not BaseException: a reply must not raise SystemExit or KeyboardInterrupt in its caller.
    return isinstance(obj, type) and issubclass(obj, Exception)


def _describe(obj: Any) -> str:
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    return f"<{type(obj).__module__}.{type(obj).__qualname__} object>"
