"""The entry point of collective training: launch (or join) the workers of a validated config.

``psserver train --mode ddp|fsdp`` builds the :class:`CollectiveConfig` from its flags
(``psserver.cli.collective_args``) and calls :func:`run_collective`.
"""

from __future__ import annotations

import functools
import logging

import torch

from psserver.collective.launcher import launch
from psserver.collective.loop import train_worker
from psserver.config.collective import CollectiveConfig

log = logging.getLogger(__name__)


def run_collective(config: CollectiveConfig) -> int:
    """Run (under torchrun) or spawn (``--nproc-per-node``) the workers; their worst exit code."""
    backend = config.launch.resolved_backend(torch.cuda.is_available())
    if config.launch.nccl_env() and backend != "nccl":
        log.warning("NCCL tunables have no effect on backend %s", backend)
    return launch(config, functools.partial(train_worker, config))
