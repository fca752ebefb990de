"""The parameter-server configurations under their former module name: ``psserver.config.server``
(``serve``), ``psserver.config.trainer`` (``train --mode ps``) and ``psserver.config.protocols``
(what both name) hold them."""

from psserver.config.optimizer import OptimizerConfig
from psserver.config.protocols import (
    COMPUTE_HELP,
    COMPUTE_MODES,
    STEP_HELP,
    STEP_MODES,
    StepMode,
    check_compute,
    default_step,
)
from psserver.config.server import (
    BUFFER_POLICIES,
    DEFAULT_STATE_DIR,
    GUARD_GROUP,
    SERVERS_GROUP,
    STATE_KEY_CHARS,
    UPDATE_MODES,
    CheckpointConfig,
    MemoryStateConfig,
    ServerConfig,
)
from psserver.config.trainer import (
    MAX_BUCKET_CAP_MB,
    MAX_TRAINERS,
    OVERLAP_MODES,
    PS_GROUP,
    TRANSPORTS,
    WIRE_DTYPES,
    TrainerConfig,
)

__all__ = [
    "BUFFER_POLICIES", "COMPUTE_HELP", "COMPUTE_MODES", "DEFAULT_STATE_DIR", "GUARD_GROUP", "MAX_BUCKET_CAP_MB",
    "MAX_TRAINERS", "OVERLAP_MODES", "PS_GROUP", "SERVERS_GROUP", "STATE_KEY_CHARS", "STEP_HELP", "STEP_MODES",
    "TRANSPORTS", "UPDATE_MODES", "WIRE_DTYPES", "CheckpointConfig", "MemoryStateConfig", "OptimizerConfig",
    "ServerConfig", "StepMode", "TrainerConfig", "check_compute", "default_step",
]
