"""Every private API of ``torch.distributed.rpc`` and ``dist_autograd`` that psserver uses.

Dynamic RPC groups leave failures to the user: a dead worker stays a member, a join that
dies holding the group's token blocks every later join. Fixing that needs the agent's
private membership call and its store keys. They live here, in one place, checked against
the torch release they were written for: ``torch.distributed.rpc`` is in maintenance mode, so
they are unlikely to move, but if they do this is the one module to read.

What psserver does *not* do is initialise RPC twice in one process (a trainer re-executes
itself to rejoin, ``psserver.ps.trainer``). Read in torch 2.14: ``init_rpc`` initialises the
``dist_autograd`` container with the worker id, once per process ("Container is already
initialized with worker_id"); the RRef context is a process-wide singleton that keeps the
first agent, so RRefs a later agent sends name the first id as their parent ("could not find
destination id"); and an agent's pipes to other workers are keyed by worker id and never
dropped when a worker leaves, so calls to an id that joins again go down the dead pipe
(EPIPE).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc

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


def remove_worker(agent, info) -> None:
    """Drop ``info`` from ``agent``'s group, as a clean leave of that worker would."""
    agent._update_group_membership(info, [], {}, False)


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


def die_inside_init_rpc(die) -> None:
    """Tests only: run ``die(agent)`` inside ``init_rpc`` while the membership token is held."""
    from torch.distributed.rpc import backend_registry

    backend_registry._set_devices_and_reverse_device_map = die
