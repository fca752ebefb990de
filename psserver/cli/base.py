"""The small interface every sub-command implements (torchx style)."""

from __future__ import annotations

import argparse
import os
from abc import ABC, abstractmethod


class SubCommand(ABC):
    name: str
    help: str

    @abstractmethod
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    @abstractmethod
    def run(self, args: argparse.Namespace) -> int: ...


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


def add_optimizer_arguments(parser: argparse.ArgumentParser, *, defaults_from_server: bool) -> None:
    suffix = " (default: the server's)" if defaults_from_server else ""
    parser.add_argument("--optimizer", choices=["sgd", "adam", "adamw", "adagrad", "rmsprop"], default=None,
                        help="server-side optimizer, one per shard, shared by all trainers" + suffix)
    parser.add_argument("--lr", type=float, default=None, help="learning rate" + suffix)
    parser.add_argument("--momentum", type=float, default=None, help="momentum (sgd, rmsprop)" + suffix)
    parser.add_argument("--weight-decay", type=float, default=None, help="L2 penalty" + suffix)


def optimizer_from_args(args: argparse.Namespace):
    """An OptimizerConfig when any optimizer flag was given, else None."""
    from psserver.config import OptimizerConfig

    given = {k: getattr(args, k) for k in ("optimizer", "lr", "momentum", "weight_decay")}
    if all(v is None for v in given.values()):
        return None
    defaults = OptimizerConfig()
    return OptimizerConfig(
        name=given["optimizer"] or defaults.name,
        lr=given["lr"] if given["lr"] is not None else defaults.lr,
        momentum=given["momentum"] if given["momentum"] is not None else defaults.momentum,
        weight_decay=given["weight_decay"] if given["weight_decay"] is not None else defaults.weight_decay,
    )
