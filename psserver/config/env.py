"""Defaults that launchers set in the environment: torchrun's ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``, Slurm's ``SLURM_PROCID`` and ``SLURM_NTASKS``, and our own
``PSSERVER_SERVER``. The CLI's flags and the library's ``psserver.connect`` read them here, so
both agree."""

from __future__ import annotations

import os

from psserver.config.common import parse_host_port

SERVER_VAR = "PSSERVER_SERVER"
"""The parameter server's ``HOST:PORT`` (or ``HOST``, port 29500) for ``--mode ps`` trainers, as
BytePS's ``DMLC_PS_ROOT_URI``/``DMLC_PS_ROOT_PORT``: ahead of ``MASTER_ADDR``/``MASTER_PORT``."""
DEFAULT_SERVER_PORT = 29500
TORCHELASTIC_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
"""What torchrun's agent (torch.distributed.elastic ``LocalElasticAgent``) puts in every
worker's environment besides RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; Slurm's srun, a
Kubeflow PyTorchJob without torchrun, or a user exporting MASTER_* by hand set none of them."""


def env_int(name: str, default: int | None) -> int | None:
    """An int from the environment (torchrun / Slurm variables), else ``default`` (also for a
    value that is not an int: a launcher's variable is a default, never an error)."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        return default


def default_rank() -> int | None:
    """RANK (torchrun), else SLURM_PROCID."""
    return env_int("RANK", env_int("SLURM_PROCID", None))


def default_world_size() -> int | None:
    """WORLD_SIZE (torchrun), else SLURM_NTASKS."""
    return env_int("WORLD_SIZE", env_int("SLURM_NTASKS", None))


def under_torchelastic() -> bool:
    """Whether torchrun (torch.distributed.run, torchelastic's agent) started this process."""
    return any(os.environ.get(name) not in (None, "") for name in TORCHELASTIC_VARS)


def default_server_address(default_port: int = DEFAULT_SERVER_PORT, option: str = "--server HOST:PORT") -> str:
    """The parameter server a ``--mode ps`` trainer joins when neither ``--server`` nor
    ``psserver.connect(address)`` names it, as ``HOST:PORT``:

    1. ``$PSSERVER_SERVER`` (``HOST:PORT``, ``[v6]:PORT``, or ``HOST`` with ``default_port``);
    2. under torchrun, nothing: ``ValueError``. torchrun's ``MASTER_ADDR:MASTER_PORT`` is its
       own rendezvous store (a TCPStore, as psserver's RPC endpoint is), never a psserver: a
       trainer pointed there connects, then waits its whole ``--connect-timeout`` for a server
       that never registers. ``MASTER_ADDR`` with port 29500 is no better a guess: 29500 is
       torchrun's own default ``--master-port`` (the same store again), and the psserver
       usually runs on hosts of its own (deploy/slurm/ps.sbatch), not on torchrun's rendezvous
       node. So no guess: the error says to name the psserver;
    3. ``$MASTER_ADDR:$MASTER_PORT``, each when set (a Slurm script or a user exporting them for
       psserver; an IPv6 ``MASTER_ADDR`` is bracketed);
    4. ``127.0.0.1:29500``.

    ``ValueError`` (one line, naming the variable) for a malformed ``$PSSERVER_SERVER``; ``option``
    is how the caller names the server otherwise (the CLI's flag, ``psserver.connect``'s argument)."""
    named = os.environ.get(SERVER_VAR, "").strip()
    if named:
        try:
            bare_v6 = named.startswith("[") and named.endswith("]")  # [v6] alone: its ':' is no port's
            host, port = parse_host_port(f"{named}:{default_port}" if bare_v6 else named, default_port=default_port)
        except ValueError as e:
            raise ValueError(f"${SERVER_VAR}={named[:80]!r} is not the psserver's HOST:PORT (or HOST): {e}") from None
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if under_torchelastic():
        raise ValueError(f"under torchrun, $MASTER_ADDR:$MASTER_PORT is torchrun's own rendezvous, not a "
                         f"psserver: name the psserver with {option} or ${SERVER_VAR}")
    host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    if ":" in host and not host.startswith("["):  # an IPv6 address, as torchrun takes it: bracketed here
        host = f"[{host}]"
    port = env_int("MASTER_PORT", default_port)
    return f"{host}:{port}"
