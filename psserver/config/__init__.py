"""Configuration as dataclasses, one per component: the CLI builds them, the rest of the code
only reads them.

Each field has a docstring; a field that is also a flag is made with
:func:`psserver.config.options.option`, which declares the flag's name, help, parser and choices
beside the default, and the CLI derives the flag from it (``psserver.cli.builder``).
Validation lives in ``__post_init__`` and raises ``ValueError``, which the CLI reports as one
line with exit code 2.
"""

from psserver.config.collective import CollectiveConfig
from psserver.config.common import DataConfig, parse_host_port
from psserver.config.control import ControlConfig, ObservabilityConfig
from psserver.config.embedding import EmbeddingConfig
from psserver.config.optimizer import OptimizerConfig
from psserver.config.schedule import LRScheduleConfig
from psserver.config.server import CheckpointConfig, MemoryStateConfig, ServerConfig
from psserver.config.trainer import TrainerConfig

__all__ = [
    "CheckpointConfig",
    "CollectiveConfig",
    "ControlConfig",
    "DataConfig",
    "EmbeddingConfig",
    "LRScheduleConfig",
    "MemoryStateConfig",
    "ObservabilityConfig",
    "OptimizerConfig",
    "ServerConfig",
    "TrainerConfig",
    "parse_host_port",
]
