"""The model registry: a model is a spec and a builder of an ``nn.Sequential`` of blocks."""


from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class TableDef:
    """One embedding table of a recommendation model."""

    name: str
    column: int
    """The column of a sample's ids that indexes this table."""
    extra_dims: int = 0
    """Columns of a row beyond ``--embedding-dim`` (1: a bias per id)."""


@dataclass(frozen=True)
class ModelSpec:
    """What the rest of psserver needs to know about a model besides its weights."""

    name: str
    build: Callable[..., nn.Module]
    """No arguments; with tables, the row width (``--embedding-dim``)."""
    input_shape: tuple[int, ...]
    """Shape of one sample (no batch dimension)."""
    num_classes: int
    """Number of outputs of the classification head."""
    description: str
    input_dtype: torch.dtype = torch.float32
    """``torch.long`` for token models."""
    tp_plan: tuple[str, dict[str, str]] | None = field(default=None, hash=False)
    """Tensor-parallel plan: ``(block class name, {submodule: "colwise" | "rowwise"})``, applied to
    every block of that class (``psserver train --mode fsdp --tp-size T``); None: the model
    cannot be tensor-parallel."""
    tp_max_degree: int | None = None
    """Largest tensor-parallel degree, which every degree must divide (a transformer's number
    of attention heads); None: no limit beyond the plan's."""


    tables: tuple[TableDef, ...] = ()
    """Embedding tables that live only on the servers (a recommendation model): the model's
    ``forward(rows, dense)`` takes one tensor of rows per table, ``[batch, dim + extra_dims]``,
    and the dense features. Empty: a dense model, ``forward(x)``."""
    embedding_dim: int = 0
    """Row width when the server does not say (``--embedding-dim``); tables only."""
    dense_features: int = 0
    """Dense inputs per sample beside the ids (tables only)."""
    loss: str = "cross_entropy"
    """The training loss of the outputs against the targets (``psserver.models.losses``)."""
    metric: str = "accuracy"
    """The held-out metric a trainer prints at the end (``psserver.models.losses``)."""

    @property
    def sparse(self) -> bool:
        """Whether the model has embedding tables on the servers."""
        return bool(self.tables)


MODELS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Add ``spec`` to :data:`MODELS`; ``ValueError`` for a spec the trainers could not run
    (checked here, at import, rather than mid-training)."""
    from psserver.models.losses import LOSSES
    from psserver.utils.metrics import METRICS

    if spec.name in MODELS:
        raise ValueError(f"model {spec.name!r} is registered twice")
    if spec.loss not in LOSSES:
        raise ValueError(f"model {spec.name!r}: unknown loss {spec.loss!r}; known: {', '.join(sorted(LOSSES))}")
    if spec.metric not in METRICS:
        raise ValueError(f"model {spec.name!r}: unknown metric {spec.metric!r}; known: {', '.join(sorted(METRICS))}")
    if spec.sparse:
        if len(spec.input_shape) != 1 or spec.input_dtype.is_floating_point:
            raise ValueError(f"model {spec.name!r} has tables: its samples must be a row of integer ids")
        columns = [t.column for t in spec.tables]
        if any(not 0 <= c < spec.input_shape[0] for c in columns) or len(set(columns)) != len(columns):
            raise ValueError(f"model {spec.name!r}: table columns {columns} must be distinct and < "
                             f"{spec.input_shape[0]}")
        if len({t.name for t in spec.tables}) != len(spec.tables):
            raise ValueError(f"model {spec.name!r}: table names must be distinct")
        if spec.embedding_dim < 1 or spec.dense_features < 0 or any(t.extra_dims < 0 for t in spec.tables):
            raise ValueError(f"model {spec.name!r}: needs embedding_dim >= 1, dense_features >= 0, extra_dims >= 0")
    MODELS[spec.name] = spec
    return spec


def check_model_name(name: str) -> ModelSpec:
    """The spec of ``name``, or ``ValueError`` listing the known ones."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(MODELS))}") from None


def get_model_spec(name: str) -> ModelSpec:
    return check_model_name(name)


def build_model(name: str, seed: int = 0, embedding_dim: int | None = None) -> nn.Module:
    """Build ``name`` with deterministic initial parameters (a model with tables: its dense
    part, for rows of ``embedding_dim``, the spec's default when None)."""
    spec = check_model_name(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if spec.sparse:
            return spec.build(embedding_dim or spec.embedding_dim)
        return spec.build()


def split_stages(model: nn.Sequential, n: int) -> list[nn.Sequential]:
    """Split ``model`` into ``n`` consecutive non-empty stages, minimising the largest
    stage's parameter count (the classic linear-partition DP; models have few blocks)."""
    blocks = list(model.children())
    if n < 1:
        raise ValueError("need at least one stage")
    if n > len(blocks):
        raise ValueError(f"model has {len(blocks)} blocks, cannot split into {n} stages")
    if n == 1:
        return [model]
    sizes = [sum(p.numel() for p in b.parameters()) for b in blocks]
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    nb = len(blocks)
    inf = float("inf")
    # best[k][j]: smallest possible max-stage size putting the first j blocks in k stages.
    best = [[inf] * (nb + 1) for _ in range(n + 1)]
    cut = [[0] * (nb + 1) for _ in range(n + 1)]
    best[0][0] = 0
    for k in range(1, n + 1):
        for j in range(k, nb + 1):
            for i in range(k - 1, j):
                cost = max(best[k - 1][i], prefix[j] - prefix[i])
                if cost < best[k][j]:
                    best[k][j], cut[k][j] = cost, i
    bounds = [nb]
    for k in range(n, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    bounds.reverse()
    return [nn.Sequential(*blocks[a:b]) for a, b in itertools.pairwise(bounds)]
