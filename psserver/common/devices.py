"""The devices of ``--devices`` (a server's stages) and ``--device`` (a trainer's replica):
named as the user wrote them, checked against this host, with CUDA indexes made explicit."""

from __future__ import annotations

import torch

from psserver.errors import UsageError


def resolve_device(name: str, flag: str) -> torch.device:
    """One device of ``flag`` (``--devices`` of the server, ``--device`` of a trainer), with its
    CUDA index made explicit (``UsageError`` when this host does not have it)."""
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"{flag} {name}: CUDA is not available on this host")
        index = dev.index if dev.index is not None else 0
        if index >= torch.cuda.device_count():
            raise UsageError(f"{flag} {name} does not exist ({torch.cuda.device_count()} GPUs visible)")
        dev = torch.device("cuda", index)
    return dev


def resolve_devices(devices: list[str] | None) -> list[torch.device]:
    """The devices of ``--devices`` (default: every visible GPU, else the CPU)."""
    if devices is None:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device(f"cuda:{i}") for i in range(n)] or [torch.device("cpu")]
    return [resolve_device(d, "--devices") for d in devices]
