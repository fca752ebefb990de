"""Step protocols, one module each, registered by name on import (see ``base``)."""

from __future__ import annotations

import importlib
import pkgutil

from psserver.ps.protocols.base import PROTOCOLS, ServerHalf, StepProtocol, TrainerHalf, get_protocol

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["PROTOCOLS", "ServerHalf", "StepProtocol", "TrainerHalf", "get_protocol"]
