"""Defaults that launchers set in the environment: torchrun's ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``, Slurm's ``SLURM_PROCID`` and ``SLURM_NTASKS``. The CLI's
flags and the library's ``psserver.connect`` read them here, so both agree."""

from __future__ import annotations

import os


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


def default_server_address(default_port: int = 29500) -> str:
    """MASTER_ADDR:MASTER_PORT when set, else 127.0.0.1:29500."""
    host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    if ":" in host and not host.startswith("["):  # an IPv6 address, as torchrun takes it: bracketed here
        host = f"[{host}]"
    port = env_int("MASTER_PORT", default_port)
    return f"{host}:{port}"
