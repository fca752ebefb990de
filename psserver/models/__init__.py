"""Models by name (entry points of ``psserver.models``) or by ``MODULE:ATTR`` reference.

psserver's own models are ``nn.Sequential`` stacks of blocks, so a server can split them into
consecutive stages over several devices; a recommendation model (``recsys``) is the dense part
beside embedding tables that live on the servers. A user's model is any ``nn.Module``.
"""

from psserver.models.registry import (
    ENTRY_POINT_GROUP,
    ModelSpec,
    TableDef,
    build_model,
    check_model_name,
    check_spec,
    get_model_spec,
    model_names,
    resolve_model,
    split_stages,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "ModelSpec",
    "TableDef",
    "build_model",
    "check_model_name",
    "check_spec",
    "get_model_spec",
    "model_names",
    "resolve_model",
    "split_stages",
]
