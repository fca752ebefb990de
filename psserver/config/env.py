"""Defaults that launchers set in the environment: torchrun's ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``, Slurm's ``SLURM_PROCID`` and ``SLURM_NTASKS``, and our own
``PSSERVER_SERVER``, ``PSSERVER_NUM_SERVERS``, ``PSSERVER_SERVER_RANK``, ``PSSERVER_COORDINATOR``,
``PSSERVER_STATE_DIR`` and ``PSSERVER_STATE_KEY``. Each is read by one function here, which the
CLI's flags and the library's ``psserver.connect`` both call, so they agree; where the variable
is unset the function returns the dataclass field's own default, passed in by the caller.

A variable that is not an int is no default (a launcher's business, not ours); one that is an int
out of range is refused, naming the variable (:class:`LauncherEnvError`), not reported as the
flag it defaults and the user never gave ("--num-trainers must be >= 1")."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from psserver.config.common import parse_host_port
from psserver.errors import UsageError

SERVER_VAR = "PSSERVER_SERVER"
"""The parameter server's ``HOST:PORT`` (or ``HOST``, port 29500) for ``--mode ps`` trainers, as
BytePS's ``DMLC_PS_ROOT_URI``/``DMLC_PS_ROOT_PORT``: ahead of ``MASTER_ADDR``/``MASTER_PORT``."""
DEFAULT_SERVER_PORT = 29500
"""The parameter server's rendezvous port (``ServerConfig.port``, ``TrainerConfig.server_port``)."""
NUM_SERVERS_VAR = "PSSERVER_NUM_SERVERS"
SERVER_RANK_VAR = "PSSERVER_SERVER_RANK"
COORDINATOR_VAR = "PSSERVER_COORDINATOR"
STATE_DIR_VAR = "PSSERVER_STATE_DIR"
STATE_KEY_VAR = "PSSERVER_STATE_KEY"
TORCHELASTIC_VARS = ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
"""What torchrun's agent (torch.distributed.elastic ``LocalElasticAgent``) puts in every
worker's environment besides RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; Slurm's srun, a
Kubeflow PyTorchJob without torchrun, or a user exporting MASTER_* by hand set none of them."""
MAX_WORLD_SIZE = 2**31 - 1
"""The most processes a launcher's ``WORLD_SIZE`` may name: torch.distributed keeps ranks and
world sizes in a C ``int`` (a larger one ended in a ``TypeError`` inside ``TCPStore``)."""


class LauncherEnvError(UsageError, ValueError):
    """A launcher's variable out of range: one line naming it. A ``UsageError`` for the CLI
    (its flags' defaults are read while the parser is built) and a ``ValueError`` for the
    configurations and ``psserver.connect``, which report those as usage errors too."""


def env_int(name: str, default: int | None, low: int | None = None, high: int | None = None,
            what: str = "") -> int | None:
    """An int from the environment (torchrun / Slurm variables), else ``default`` (also for a
    value that is not an int). An int outside ``low..high`` (either may be None) is a
    :class:`LauncherEnvError` naming the variable and ``what`` it is the default of."""
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        number = int(value)
    except ValueError:
        return default
    if (low is not None and number < low) or (high is not None and number > high):
        shown = value if len(value) <= 24 else value[:21] + "..."
        bound = f"must be >= {low}" if low is not None and number < low else f"must be <= {high}"
        raise LauncherEnvError(f"${name}={shown}{f' ({what})' if what else ''} {bound}")
    return number


def default_rank() -> int | None:
    """RANK (torchrun), else SLURM_PROCID; ``LauncherEnvError`` for a negative one."""
    what = "the default trainer rank, --rank"
    rank = env_int("SLURM_PROCID", None, 0, MAX_WORLD_SIZE - 1, what)
    return env_int("RANK", rank, 0, MAX_WORLD_SIZE - 1, what)


def default_world_size() -> int | None:
    """WORLD_SIZE (torchrun), else SLURM_NTASKS; ``LauncherEnvError`` for one below 1."""
    what = "the default number of trainers, --num-trainers"
    world = env_int("SLURM_NTASKS", None, 1, MAX_WORLD_SIZE, what)
    return env_int("WORLD_SIZE", world, 1, MAX_WORLD_SIZE, what)


@dataclass(frozen=True)
class LauncherEnv:
    """A worker's place as an env:// launcher (torchrun) states it: RANK, WORLD_SIZE, LOCAL_RANK
    and LOCAL_WORLD_SIZE (1 when absent)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def _launcher_var(name: str, low: int, high: int, default: str | None = None) -> int:
    value = os.environ.get(name) or default
    shown = repr(value if value is None or len(value) <= 24 else value[:21] + "...")
    try:
        number = int(value or "")
    except ValueError:
        raise LauncherEnvError(f"${name}={shown} is not an int (torchrun and Slurm set it to one in "
                               f"{low}..{high})") from None
    if not low <= number <= high:
        raise LauncherEnvError(f"${name}={shown} is out of range {low}..{high}")
    return number


def launcher_env() -> LauncherEnv:
    """The launcher's variables, each checked against the others: ``LauncherEnvError`` (one line,
    naming the variables) for a rank at or past the world size, which waited five minutes in
    the rendezvous for ranks that never come, and for anything else no launcher sets."""
    world = _launcher_var("WORLD_SIZE", 1, MAX_WORLD_SIZE)
    rank = _launcher_var("RANK", 0, MAX_WORLD_SIZE - 1)
    if rank >= world:
        raise LauncherEnvError(f"$RANK={rank} must be below $WORLD_SIZE={world} (ranks are 0..{world - 1})")
    local_world = _launcher_var("LOCAL_WORLD_SIZE", 1, MAX_WORLD_SIZE, "1")
    if local_world > world:
        raise LauncherEnvError(f"$LOCAL_WORLD_SIZE={local_world} is more than $WORLD_SIZE={world}")
    local_rank = _launcher_var("LOCAL_RANK", 0, MAX_WORLD_SIZE - 1)
    if os.environ.get("LOCAL_WORLD_SIZE") and local_rank >= local_world:
        raise LauncherEnvError(f"$LOCAL_RANK={local_rank} must be below $LOCAL_WORLD_SIZE={local_world}")
    if local_rank >= world:
        raise LauncherEnvError(f"$LOCAL_RANK={local_rank} must be below $WORLD_SIZE={world}")
    return LauncherEnv(rank, world, local_rank, local_world)


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

    ``ValueError`` (one line, naming the variable) for a malformed ``$PSSERVER_SERVER`` or a
    ``$MASTER_PORT`` that is no port; ``option``
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
    port = env_int("MASTER_PORT", default_port, 1, 65535, "the default server port")
    return f"{host}:{port}"


def default_serve_port(default: int = DEFAULT_SERVER_PORT) -> int:
    """``psserver serve --port``: ``$MASTER_PORT`` (a Slurm script's), else ``default``."""
    return env_int("MASTER_PORT", default)


def default_num_servers(default: int) -> int:
    """``--num-servers``: ``$PSSERVER_NUM_SERVERS``, else ``default``."""
    return env_int(NUM_SERVERS_VAR, default)


def server_rank_from_env(default: int) -> int:
    """``--server-rank``, where launchers say it: ``$PSSERVER_SERVER_RANK``, Slurm's task rank, a
    StatefulSet pod's ordinal (``ps-2``); else ``default``."""
    for name in (SERVER_RANK_VAR, "SLURM_PROCID"):
        rank = env_int(name, None)
        if rank is not None:
            return rank
    m = re.search(r"-(\d+)$", os.environ.get("HOSTNAME", "") or socket.gethostname())
    return int(m.group(1)) if m else default


def default_coordinator(default: str | None) -> str | None:
    """``--coordinator``: ``$PSSERVER_COORDINATOR``, else ``$MASTER_ADDR:$MASTER_PORT``, else ``default``."""
    if os.environ.get(COORDINATOR_VAR):
        return os.environ[COORDINATOR_VAR]
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    return f"{addr}:{port}" if addr and port else default


def default_state_dir() -> str | None:
    """``--state-dir``: ``$PSSERVER_STATE_DIR`` (None: off, or the supervisor's default)."""
    return os.environ.get(STATE_DIR_VAR)


def default_state_key(default: str | None) -> str | None:
    """``--state-key``: ``$PSSERVER_STATE_KEY``, else ``default``."""
    return os.environ.get(STATE_KEY_VAR, default)
