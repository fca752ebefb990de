"""The small interface every sub-command implements (torchx style)."""

from __future__ import annotations

import argparse
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager

from psserver.errors import UsageError


class SubCommand(ABC):
    """One verb: ``psserver <name>``.

    ``run`` raises :class:`~psserver.errors.UsageError` for anything the user can fix (one
    line, exit code 2); any other exception is an internal error (exit code 1, the traceback
    in a log file). Configurations validate in ``__post_init__`` with ``ValueError``: build
    them inside :func:`config_errors`.
    """

    name: str
    help: str

    @abstractmethod
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    @abstractmethod
    def run(self, args: argparse.Namespace) -> int: ...


@contextmanager
def config_errors() -> Iterator[None]:
    """Report a ``ValueError`` raised while building a configuration from the flags (the
    config dataclasses validate in ``__post_init__``) as a :class:`UsageError`.

    Only the construction goes inside: a ``ValueError`` from running the command is a bug.
    """
    try:
        yield
    except UsageError:
        raise
    except ValueError as e:
        raise UsageError(str(e)) from e


def env_int(name: str, default: int | None) -> int | None:
    """An int from the environment (torchrun / Slurm variables), else ``default``."""
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
    return env_int("WORLD_SIZE", env_int("SLURM_NTASKS", None))


def default_server_address(default_port: int = 29500) -> str:
    """MASTER_ADDR:MASTER_PORT when set, else 127.0.0.1:29500."""
    host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    port = env_int("MASTER_PORT", default_port)
    return f"{host}:{port}"
