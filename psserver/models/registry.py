"""Models by name or reference: a model is a spec (what psserver knows of it) and a builder.

``--model NAME`` looks ``NAME`` up in the entry-point group ``psserver.models`` (psserver's own
models are registered there, so there is one path); ``--model MODULE:ATTR`` names a user's
``nn.Module`` class or a function returning one, built with ``--model-args``. Any module
trains; only an ``nn.Sequential`` can be split into stages over several devices.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import itertools
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from psserver.errors import UserCodeError
from psserver.utils.references import call_user, check_arguments, is_reference, load_reference


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
    """Called with ``args`` as keywords; with tables, the row width (``--embedding-dim``) first."""
    input_shape: tuple[int, ...] | None
    """Shape of one sample (no batch dimension); None: not known (a user's model, whose data
    says what it takes)."""
    num_classes: int | None
    """Number of outputs of the classification head; None: not known."""
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
    args: dict[str, Any] = field(default_factory=dict, hash=False)
    """Keyword arguments of ``build`` (``--model-args``)."""

    @property
    def sparse(self) -> bool:
        """Whether the model has embedding tables on the servers."""
        return bool(self.tables)


ENTRY_POINT_GROUP = "psserver.models"
"""Bare model names are entry points of this group (torchx's ``module:function`` form): the
built-in models are registered in psserver's own ``pyproject.toml``, a user's package may
register its own the same way (``[project.entry-points."psserver.models"] mynet =
"mypkg.models:MyNet"``)."""


def check_spec(spec: ModelSpec) -> ModelSpec:
    """``spec``, checked: ``ValueError`` for a spec the trainers could not run (found when it
    is defined, not mid-training)."""
    from psserver.models.losses import LOSSES
    from psserver.utils.eval_metrics import metric_names

    if spec.loss not in LOSSES:
        raise ValueError(f"model {spec.name!r}: unknown loss {spec.loss!r}; known: {', '.join(sorted(LOSSES))}")
    if spec.metric not in metric_names():
        raise ValueError(f"model {spec.name!r}: unknown metric {spec.metric!r}; known: {', '.join(metric_names())}")
    if spec.sparse:
        if spec.input_shape is None or len(spec.input_shape) != 1 or spec.input_dtype.is_floating_point:
            raise ValueError(f"model {spec.name!r} has tables: its samples must be a row of integer ids")
        columns = [t.column for t in spec.tables]
        if any(not 0 <= c < spec.input_shape[0] for c in columns) or len(set(columns)) != len(columns):
            raise ValueError(f"model {spec.name!r}: table columns {columns} must be distinct and < "
                             f"{spec.input_shape[0]}")
        if len({t.name for t in spec.tables}) != len(spec.tables):
            raise ValueError(f"model {spec.name!r}: table names must be distinct")
        if spec.embedding_dim < 1 or spec.dense_features < 0 or any(t.extra_dims < 0 for t in spec.tables):
            raise ValueError(f"model {spec.name!r}: needs embedding_dim >= 1, dense_features >= 0, extra_dims >= 0")
    return spec


@functools.cache
def _entry_points() -> dict[str, str]:
    """Name -> ``MODULE:ATTR`` of every model in :data:`ENTRY_POINT_GROUP`. Where psserver runs
    from a source tree that was never installed (no package metadata), its own entries are
    read from the ``pyproject.toml`` beside the package: the same declaration either way."""
    found = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}
    try:
        importlib.metadata.distribution("psserver")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
        if pyproject.is_file():
            declared = tomllib.loads(pyproject.read_text())["project"]["entry-points"][ENTRY_POINT_GROUP]
            found = {**declared, **found}
    return found


def model_names() -> list[str]:
    """The names ``--model`` takes without a ``MODULE:ATTR`` reference, sorted."""
    return sorted(_entry_points())


def resolve_model(reference: str, args: dict[str, Any] | None = None) -> ModelSpec:
    """The spec of ``--model`` (a name of :data:`ENTRY_POINT_GROUP`, or ``MODULE:ATTR``) with
    ``--model-args``; ``ValueError`` of one line for a name or reference that does not resolve,
    an object that is not a model, or arguments it does not take.

    What a reference may name: a :class:`ModelSpec` (psserver's own models: they know their
    input), an ``nn.Module`` subclass, or a callable returning an ``nn.Module``. The model is not
    built here (the server of a model-agnostic job never builds it)."""
    reference = reference.strip()
    args = dict(args or {})
    if is_reference(reference):
        target = load_reference(reference, "--model")
    else:
        points = _entry_points()
        if reference not in points:
            raise UserCodeError(f"unknown model {reference!r}; known: {', '.join(sorted(points))} "
                             "(or MODULE:ATTR, an nn.Module class or a function returning one)")
        target = load_reference(points[reference], f"--model {reference} (entry point)")
    if isinstance(target, ModelSpec):
        spec = target
    elif callable(target) and not isinstance(target, nn.Module):  # a class, or a function
        spec = ModelSpec(reference, target, None, None, f"{reference} (user model)")
    else:
        raise UserCodeError(f"--model {reference} is a {type(target).__name__}, not an nn.Module class or a "
                         "function returning one")
    if args:
        positional = (spec.embedding_dim,) if spec.sparse else ()
        check_arguments(spec.build, positional, args, f"--model {spec.name}")
        spec = dataclasses.replace(spec, args=args)
    return spec


def check_model_name(name: str) -> ModelSpec:
    """The spec of ``name`` (a name or ``MODULE:ATTR``), or ``ValueError`` listing the known names."""
    return resolve_model(name)


def get_model_spec(name: str, args: dict[str, Any] | None = None) -> ModelSpec:
    return resolve_model(name, args)


def build_model(model: str | ModelSpec, seed: int = 0, embedding_dim: int | None = None) -> nn.Module:
    """Build ``model`` (a spec, or a name or reference) with deterministic initial parameters
    (a model with tables: its dense part, for rows of ``embedding_dim``, the spec's default when
    None). ``ValueError`` of one line when the user's code fails or returns no ``nn.Module``."""
    spec = model if isinstance(model, ModelSpec) else resolve_model(model)
    positional = (embedding_dim or spec.embedding_dim,) if spec.sparse else ()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        built = call_user(spec.build, positional, spec.args, f"--model {spec.name}")
    if not isinstance(built, nn.Module):
        raise UserCodeError(f"--model {spec.name} returned a {type(built).__name__}, not an nn.Module")
    _check_built(built, spec)
    return built


def model_bytes(spec: ModelSpec, embedding_dim: int | None = None) -> int | None:
    """The bytes of the state ``spec`` builds, sized on the meta device (nothing allocated); None
    when its code cannot run there. A trainer sizes a model someone else named before it builds
    it: its arguments (a vocabulary of 10^8, say) decide the memory that takes."""
    positional = (embedding_dim or spec.embedding_dim,) if spec.sparse else ()
    try:
        with torch.device("meta"):
            built = call_user(spec.build, positional, spec.args, f"--model {spec.name}")
    except Exception:  # noqa: BLE001 - code that needs real values: built for real, as before
        return None
    if not isinstance(built, nn.Module):
        return None
    return sum(t.numel() * t.element_size() for t in built.state_dict().values())


def _check_built(model: nn.Module, spec: ModelSpec) -> None:
    """``UserCodeError`` (one line) for a model no trainer or server can hold: one with a tensor
    on the meta device (no values to send or train), or, dense, with no parameter at all (a
    model with tables may keep all of its parameters in them)."""
    named = itertools.chain(model.named_parameters(), model.named_buffers())
    on_meta = next((name for name, t in named if t.is_meta), None)
    if on_meta is not None:
        raise UserCodeError(f"--model {spec.name} returned a model on the meta device ({on_meta!r} has no values): "
                            "build it on the CPU")
    if not spec.sparse and next(model.parameters(), None) is None:
        raise UserCodeError(f"--model {spec.name} returned a {type(model).__name__} with no parameters: nothing "
                            "to train")


def split_stages(model: nn.Module, n: int) -> list[nn.Module]:
    """Split ``model`` into ``n`` consecutive non-empty stages, minimising the largest
    stage's parameter count (the classic linear-partition DP; models have few blocks)."""
    if n < 1:
        raise ValueError("need at least one stage")
    if n == 1:  # whatever its blocks: a model of one layer, or none, is one stage
        return [model]
    blocks = list(model.children())
    if n > 1 and not isinstance(model, nn.Sequential):
        raise ValueError(f"a {type(model).__name__} is not an nn.Sequential of blocks: it runs as one stage "
                         "(give the server one device)")
    if n > len(blocks):
        raise ValueError(f"model has {len(blocks)} blocks, cannot split into {n} stages")
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
