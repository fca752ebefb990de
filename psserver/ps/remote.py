"""Functions trainers call on the server over RPC (resolved by name on the server).

Each is a thin forward to the running :class:`ParameterServer`; keeping them module-level
and small keeps the pickled call tiny (module + function name + arguments).
"""

from __future__ import annotations

import torch


def join(rank: int, name: str, host: str, pid: int, optimizer: dict | None) -> dict:
    from psserver.ps.server import current_server

    return current_server().join(rank, name, host, pid, optimizer)


def forward(name: str, x: torch.Tensor, report: tuple | None, fold: bool = False) -> torch.Tensor:
    from psserver.ps.server import current_server

    return current_server().forward(name, x, report, fold)


def evaluate(name: str, x: torch.Tensor) -> torch.Tensor:
    from psserver.ps.server import current_server

    return current_server().evaluate(name, x)


def heartbeat(name: str, report: tuple | None) -> str:
    from psserver.ps.server import current_server

    return current_server().heartbeat(name, report)


def leave(name: str, report: tuple | None) -> None:
    from psserver.ps.server import current_server

    current_server().leave(name, report)


def train_step(name: str, x: torch.Tensor, y: torch.Tensor, report: tuple | None) -> float:
    from psserver.ps.server import current_server

    return current_server().train_step(name, x, y, report)


def chained_step(name: str, grad_out: torch.Tensor | None, x: torch.Tensor | None,
                 report: tuple | None) -> torch.Tensor | None:
    from psserver.ps.server import current_server

    return current_server().chained_step(name, grad_out, x, report)
