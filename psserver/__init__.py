"""psserver: a parameter-server service for PyTorch, a library first and a command second.

The library (a training loop of your own)::

    import psserver
    with psserver.connect("10.0.0.5:29500", rank=0, num_trainers=2) as ps:
        model = ps.replica(MyNet())
        loader = DataLoader(ds, batch_size=64, sampler=ps.sampler(ds))
        for epoch in range(ps.epoch, 3):
            loader.sampler.set_epoch(epoch)
            for x, y in loader:
                loss_fn(model(x), y).backward()
                ps.step()

Public names:

- ``connect(address, *, rank, num_trainers, reconnect, ...)``: join a ``psserver serve`` job
  as a trainer; returns a ``Connection``.
- ``Connection``: this process's membership: ``sampler(dataset)``, ``evaluate(data)``,
  ``allreduce(value)``, ``lr``, ``global_step``, ``staleness``, ``epoch``, ``steps``,
  ``samples``, ``before_rejoin(fn)``, ``close()``. It steps one of three ways, each an object of
  its own (``ps.stepping``) whose methods it passes on: ``replica(model)`` makes a ``Replica``
  (your own loop: ``step()``, ``sync()``, ``local_sgd()``, ``local_steps``, ``rows(ids)``,
  ``tables``), ``parameter_rrefs()`` a ``RemoteModel`` (PyTorch's RPC tutorial loop:
  ``forward(x)``), ``join()`` returns ``ModelSteps`` (``psserver train``'s loop:
  ``train_step(x, y, samples=...)``).
- ``DistributedOptimizer(ps, named_parameters, backward_passes_per_step=1)``: Horovod's and
  BytePS's optimizer wrapper, with ``synchronize()`` and ``skip_synchronize()`` for AMP.
- ``read(address, *, token_file, dtype, device, name)``: a ``Reader`` of a running server's
  weights that never trains (RL rollout workers, serving): ``latest()``, ``wait(newer_than,
  timeout)``, ``subscribe()``, ``load_into(model)``, each a ``Version`` of one global step; and
  ``rows(table, ids)``, an embedding table's rows as held now.
- ``UsageError``, ``ServerLost``, ``Evicted``: what the library raises.

The command line: ``psserver serve``, ``psserver train`` (``--entry MODULE:FUNCTION`` runs a
loop function of yours with a connected ``ps``), ``psserver status``, ``psserver pull``,
``psserver demo``.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["Connection", "DistributedOptimizer", "Evicted", "Reader", "ServerLost", "UsageError", "connect", "read"]

_LAZY = {
    "connect": "psserver.trainer.library",
    "Connection": "psserver.trainer.connection",
    "DistributedOptimizer": "psserver.trainer.optimizer",
    "read": "psserver.reader.reader",
    "Reader": "psserver.reader.reader",
    "UsageError": "psserver.errors",
    "ServerLost": "psserver.errors",
    "Evicted": "psserver.errors",
}

def __getattr__(name: str) -> Any:
    """The library's names, imported on first use: the command line (``psserver --help``) does
    not pay for torch's RPC stack."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'psserver' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
