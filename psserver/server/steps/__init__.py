"""The server halves of the step protocols, one module per ``--step`` name, registered on
import (see ``base``); each protocol's trainer half is the module of the same name in
``psserver.trainer.steps``."""

from __future__ import annotations

import importlib
import pkgutil

from psserver.server.steps.base import HALVES, ServerHalf, server_half

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["HALVES", "ServerHalf", "server_half"]
