"""Model registry: every dense model is built as an ``nn.Sequential`` of blocks so the server can
split it into consecutive stages, one per device; a recommendation model (``recsys``) is the
dense part beside embedding tables that live on the servers.

Register new models with :func:`register`; the CLI and the server only use names.
"""

from psserver.models import builtin, llama, recsys  # noqa: E402,F401 - each registers its models
from psserver.models.registry import (
    MODELS,
    ModelSpec,
    TableDef,
    build_model,
    check_model_name,
    get_model_spec,
    register,
    split_stages,
)

__all__ = [
    "MODELS",
    "ModelSpec",
    "TableDef",
    "build_model",
    "check_model_name",
    "get_model_spec",
    "register",
    "split_stages",
]
