"""Every private API of ``torch.distributed.rpc`` and ``dist_autograd`` that psserver uses.

Dynamic RPC groups leave failures to the user: a dead worker stays a member, a join that
dies holding the group's token blocks every later join. Fixing that needs the agent's
private membership call and its store keys. They live here, in one place, checked against
the torch release they were written for: ``torch.distributed.rpc`` is in maintenance mode, so
they are unlikely to move, but if they do this is the one module to read.

What psserver does *not* do is initialise RPC twice in one process (a trainer re-executes
itself to rejoin, ``psserver.trainer.loop``). Read in torch 2.14: ``init_rpc`` initialises the
``dist_autograd`` container with the worker id, once per process ("Container is already
initialized with worker_id"); the RRef context is a process-wide singleton that keeps the
first agent, so RRefs a later agent sends name the first id as their parent ("could not find
destination id"); and an agent's pipes to other workers are keyed by worker id and never
dropped when a worker leaves, so calls to an id that joins again go down the dead pipe
(EPIPE).

RPC also runs whatever function a message names: :func:`restrict_unpickler` puts an unpickler
in front of it that knows only psserver's RPC surface (the policy is
``psserver.common.rpc_allowlist``).
"""

from __future__ import annotations

import io
import logging
import pickle
import threading
from typing import Any

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.distributed.rpc.internal as rpc_internal

from psserver.common import rpc_allowlist

log = logging.getLogger(__name__)

WRITTEN_FOR = "2.14"
"""The torch release (major.minor) whose private RPC API this module was written against."""

TOKEN_KEY = "RpcGroupManagementToken"
"""Store key of the group's membership token (held by a worker while it joins or leaves)."""
ALL_WORKERS_KEY = "names/_ALL_WORKER_INFOS"
"""Store key listing ``name-id,`` of every registered worker."""

_checked = False


def check_version() -> None:
    """Warn once when the running torch is not the release these private APIs were read in."""
    global _checked
    if _checked:
        return
    _checked = True
    release = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if release != WRITTEN_FOR:
        log.warning("psserver uses private torch.distributed.rpc APIs written for torch %s; this is torch %s: "
                    "membership repair may not work", WRITTEN_FOR, torch.__version__)


def worker_key(rpc_id: int) -> str:
    """Store key that maps an RPC id to its worker name."""
    return f"names/{rpc_id}"


def agent_is_set() -> bool:
    return rpc.api._is_current_rpc_agent_set()


def current_agent():
    return rpc.api._get_current_rpc_agent()


def worker_info_or_name() -> str:
    """This worker as torch names it in a remote error (``WorkerInfo(id=0, name=psserver)``)."""
    return str(current_agent().get_worker_info()) if agent_is_set() else "WorkerInfo(?)"


def remove_worker(agent, info) -> None:
    """Drop ``info`` from ``agent``'s group, as a clean leave of that worker would (keeping
    this agent's devices and the other workers' reply maps: :func:`leave_keeping_maps`)."""
    leave_keeping_maps(agent, info)


# ---- CUDA tensors across a dynamic group (psserver.common.transport's device-map path)
#
# Read in torch 2.14 (TensorPipeAgent::updateGroupMembership): a reply's CUDA tensors go by the
# replier's reverse device map for the caller, which a dynamic join never gives the server (the
# joiner sends the reverse maps of maps that point at *it*); and every leave, whoever leaves,
# runs ``_update_group_membership(info, [], {}, False)`` on each member, which keeps only the
# devices and reverse maps it is passed: all of them erased. So the server adds the reverse map
# of each device-map trainer itself, and a leave is applied here with the devices and maps to
# keep (never erased and put back: a CUDA message read in between would find no stream).

_reply_maps: dict[str, dict[torch.device, torch.device]] = {}
_reply_maps_lock = threading.Lock()


def map_replies(worker: str, device_map: dict[torch.device, torch.device]) -> None:
    """Let replies to ``worker`` carry CUDA tensors: ``device_map`` takes each local device to
    the worker's (the reverse of the worker's own map to this process)."""
    with _reply_maps_lock:
        _reply_maps[worker] = dict(device_map)
    restore_device_maps()


def unmap_replies(worker: str) -> None:
    with _reply_maps_lock:
        _reply_maps.pop(worker, None)


def _kept_maps(leaving: str | None = None) -> dict[str, dict[torch.device, torch.device]]:
    with _reply_maps_lock:
        return {name: dict(m) for name, m in _reply_maps.items() if name != leaving}


def leave_keeping_maps(agent, info) -> None:
    """``info``'s leave of ``agent``'s group, passing the devices it was set up with and every
    reply map but the leaver's: the only ones a leave keeps (torch erases the rest)."""
    agent._update_group_membership(info, list(agent._get_backend_options().devices), _kept_maps(info.name), False)


def restore_device_maps() -> None:
    """Give the agent back its configured devices and the reply maps of :func:`map_replies`
    (no-op for an agent of the CPU only, or before ``init_rpc``)."""
    if not agent_is_set():
        return
    agent = current_agent()
    devices = list(agent._get_backend_options().devices)
    maps = _kept_maps()
    if devices or maps:
        # As a join of this worker: adds the devices and the maps it lacks, changes nothing else.
        agent._update_group_membership(agent.get_worker_info(), devices, maps, True)


def update_group_membership(worker_info, my_devices, reverse_device_map, is_join):
    """What a peer's join or leave runs here (torch's ``_update_group_membership``, which RPC
    messages name: ``rpc_allowlist.REPLACED``), then :func:`restore_device_maps`."""
    from torch.distributed.rpc._utils import _update_group_membership
    from torch.distributed.rpc.internal import RemoteException

    try:
        if is_join:
            ret = _update_group_membership(worker_info, my_devices, reverse_device_map, is_join)
        else:  # torch's leave passes nothing to keep: this agent's own devices and maps are kept
            ret = leave_keeping_maps(current_agent(), worker_info)
    except RuntimeError as e:
        # The store went with a server that died mid-join (DistNetworkError). Raised, torch would
        # print a traceback here; returned, the joiner's call fails with the same error instead.
        log.warning("a peer's %s could not be taken in (%s)", "join" if is_join else "leave",
                    str(e).splitlines()[0] if str(e) else type(e).__name__)
        return RemoteException(str(e), type(e))
    restore_device_maps()
    return ret


def tell_worker_removed(peer, info) -> None:
    """Ask ``peer`` to drop ``info`` from its own view of the group (fire and forget)."""
    from torch.distributed.rpc._utils import _update_group_membership

    rpc.rpc_async(peer, _update_group_membership, args=(info, [], {}, False), timeout=5)


def current_autograd_context_id() -> int | None:
    """The ``dist_autograd`` context of the RPC being handled, or None outside one."""
    try:
        return dist_autograd._current_context()._context_id()
    except RuntimeError:  # no context on this thread (an in-process call)
        return None


def release_autograd_context(context_id: int) -> None:
    """Free a context a dead trainer can no longer release (no-op if already gone)."""
    try:
        dist_autograd._release_context(context_id)
    except RuntimeError:
        pass


_CONTEXT_ID_BITS = 48
"""torch numbers a dist_autograd context ``worker_id << 48 | counter`` (``DistAutogradContainer``)."""


def context_worker(context_id: int) -> int:
    """The RPC worker id that created ``context_id``."""
    return context_id >> _CONTEXT_ID_BITS


def worker_id(name: str) -> int | None:
    """The RPC id of worker ``name``; None when the agent does not know it."""
    try:
        return rpc.get_worker_info(name).id
    except RuntimeError:
        return None


def autograd_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """The gradients ``context_id`` accumulated for this process's tensors."""
    return dist_autograd.get_gradients(context_id)


def new_local_optimizer(optim_cls: type, local_params_rref: list, *args: Any, **kwargs: Any) -> rpc.RRef:
    """``DistributedOptimizer``'s remote constructor (an RRef to a ``_LocalOptimizer``)."""
    from torch.distributed.optim.optimizer import _LocalOptimizer  # imports FSDP and sympy: when used

    return rpc.RRef(_LocalOptimizer(optim_cls, local_params_rref, *args, **kwargs))


def local_optimizer_of(local_optim_rref: rpc.RRef) -> Any:
    """The optimizer inside the ``_LocalOptimizer`` an RRef of :func:`new_local_optimizer` holds."""
    from torch.distributed.optim.optimizer import _LocalOptimizer

    local = local_optim_rref.local_value()
    if not isinstance(local, _LocalOptimizer):
        raise ValueError("not a local optimizer")
    return local.optim


class RestrictedUnpickler(pickle.Unpickler):
    """The RPC layer's unpickler, that finds only the globals of psserver's RPC surface
    (``rpc_allowlist.find_global``; anything else raises ``RefusedCall``)."""

    def find_class(self, module: str, name: str) -> Any:
        return rpc_allowlist.find_global(module, name)


def _restricted_deserialize(binary_data: bytes, tensor_table: list[torch.Tensor]) -> Any:
    """``_InternalRPCPickler.deserialize`` of torch 2.14 with :class:`RestrictedUnpickler`, and
    the thread's tensor table restored whatever happens (torch leaves it behind on any error
    but ``AttributeError``, as a refusal would)."""
    tables = rpc_internal._thread_local_tensor_tables
    old_recv_tables = tables.recv_tables if hasattr(tables, "recv_tables") else None  # a nested call's
    tables.recv_tables = tensor_table
    try:
        try:
            ret = RestrictedUnpickler(io.BytesIO(binary_data)).load()
        except AttributeError as e:
            # As torch: a function missing on this side is returned, so that the call fails with it.
            ret = AttributeError(f"{e} Default RPC pickler does not serialize function code. Ensure that UDFs "
                                 "are defined on both caller and callee modules.")
            ret.__cause__ = e
        if type(ret) is rpc_internal.PythonUDF and ret.func is rpc_allowlist.rpc_getattr:
            raise rpc_allowlist.refuse("builtins.getattr")  # a call of getattr itself: it only serves unpickling
    finally:
        if old_recv_tables is not None:
            tables.recv_tables = old_recv_tables
        else:
            del tables.recv_tables
    return ret


def restrict_unpickler() -> None:
    """Make the RPC layer unpickle only psserver's RPC surface (``psserver.common.rpc_allowlist``).

    Called before ``init_rpc``, so that no message is ever read without it; idempotent. Every
    incoming Python call, reply and remote exception goes through ``internal.deserialize``,
    which torch's C++ handler calls and which calls ``_internal_rpc_pickler.deserialize``: that
    instance attribute is replaced, and the module's ``_unpickler`` too, for any other path
    through torch's own ``deserialize``."""
    pickler = rpc_internal._internal_rpc_pickler
    if vars(pickler).get("deserialize") is _restricted_deserialize:
        return
    pickler.deserialize = _restricted_deserialize
    rpc_internal._unpickler = RestrictedUnpickler
    log.debug("RPC unpickler restricted to psserver's RPC surface")

