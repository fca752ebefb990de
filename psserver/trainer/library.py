"""``psserver.connect``: the library's one entry point, its arguments checked (one line each)
into a :class:`~psserver.config.TrainerConfig` and a :class:`~psserver.trainer.connection.Connection`
made of it. Nothing is sent before the connection joins."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from psserver.config import TrainerConfig, parse_host_port
from psserver.config.env import default_rank, default_server_address, default_world_size
from psserver.errors import UsageError
from psserver.trainer.connection import Connection


def connect(address: str | None = None, *, rank: int | None = None, num_trainers: int | None = None,
            reconnect: bool = False, token_file: str | None = None, device: str = "cpu", wire_dtype: str = "fp32",
            transport: str = "auto", overlap: str = "off", connect_timeout: float = 60.0, rpc_timeout: float = 60.0,
            step: str | None = None, handle_signals: bool = True, config: TrainerConfig | None = None) -> Connection:
    """Connect this process to the psserver at ``address`` (``HOST:PORT``) as trainer ``rank``.

    Defaults come from the environment as for ``psserver train``: ``address`` from
    ``$PSSERVER_SERVER``, else (not under torchrun, whose ``MASTER_PORT`` is its own rendezvous:
    there it is a :class:`~psserver.errors.UsageError`) ``$MASTER_ADDR:$MASTER_PORT``, else
    127.0.0.1:29500 (:func:`psserver.config.env.default_server_address`), ``rank`` from ``$RANK`` or
    ``$SLURM_PROCID`` (else 0), ``num_trainers`` (the data shards) from ``$WORLD_SIZE`` or
    ``$SLURM_NTASKS`` (else the server's sync K), the join token from ``token_file`` or
    ``$PSSERVER_JOIN_TOKEN``. ``reconnect``: when the server evicts this trainer or goes away,
    re-execute this script, which rejoins and continues (:attr:`Connection.epoch`); without it,
    :class:`~psserver.errors.Evicted` or :class:`~psserver.errors.ServerLost`. ``device``,
    ``wire_dtype`` and ``transport`` as ``psserver train``'s flags; ``overlap`` too, for
    :meth:`Connection.train_step` (off by default: a loop that runs its own backward and calls
    :meth:`Connection.step` hands in each gradient before its next forward). ``handle_signals``:
    SIGTERM and SIGINT leave after the step in flight (main thread only). ``config``: a whole ``TrainerConfig`` instead
    (``psserver train --entry`` passes its own); the other arguments are then ignored.

    Bad arguments raise :class:`~psserver.errors.UsageError`. Nothing is sent before
    :meth:`Connection.replica` (or :meth:`Connection.parameter_rrefs`), which joins."""
    if config is not None and not isinstance(config, TrainerConfig):
        raise UsageError(f"psserver.connect: config is a psserver.config.TrainerConfig, not {type(config).__name__}")
    if config is None:
        if not isinstance(handle_signals, bool):
            raise UsageError(f"psserver.connect: handle_signals is True or False, not {handle_signals!r}")
        config = _config(address, rank=rank, num_trainers=num_trainers, reconnect=reconnect, token_file=token_file,
                         device=device, wire_dtype=wire_dtype, transport=transport, overlap=overlap,
                         connect_timeout=connect_timeout, rpc_timeout=rpc_timeout, step=step)
    return Connection(config, handle_signals=handle_signals)


def _config(address: str | None, **kw: Any) -> TrainerConfig:
    if address is not None and not isinstance(address, str):
        raise UsageError(f"psserver.connect: address is 'HOST:PORT', a str, not {type(address).__name__}")
    if address is not None and not address.strip():
        raise UsageError("psserver.connect: address '' names no server (None takes the default)")
    if not isinstance(kw.get("reconnect", False), bool):
        raise UsageError(f"psserver.connect: reconnect is True or False, not {kw['reconnect']!r}")
    for name in ("device", "wire_dtype", "transport", "overlap"):
        if name in kw and not isinstance(kw[name], str):
            raise UsageError(f"psserver.connect: {name} is a str, not {type(kw[name]).__name__}")
    if kw.get("token_file") is not None and not isinstance(kw["token_file"], str | os.PathLike):
        raise UsageError(f"psserver.connect: token_file is a path, not {type(kw['token_file']).__name__}")
    try:
        host, port = parse_host_port(address or default_server_address(option="psserver.connect('HOST:PORT')"),
                                     default_port=29500)
    except ValueError as e:
        raise UsageError(f"psserver.connect: {e}") from None
    rank = kw.pop("rank")
    num_trainers = kw.pop("num_trainers")
    token_file = kw.pop("token_file")
    step = kw.pop("step")
    try:
        return TrainerConfig(rank=rank if rank is not None else (default_rank() or 0), server_host=host,
                             server_port=port, num_trainers=num_trainers if num_trainers is not None
                             else default_world_size(), join_token_file=Path(token_file) if token_file else None,
                             step=step, progress=False, **kw)
    except (ValueError, TypeError) as e:  # TypeError: a comparison of a value of the wrong type
        raise UsageError(f"psserver.connect: {e}") from None
