"""The model registry: a model is a spec and a builder of an ``nn.Sequential`` of blocks."""


from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """What the rest of psserver needs to know about a model besides its weights."""

    name: str
    build: Callable[[], nn.Sequential]
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


MODELS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    if spec.name in MODELS:
        raise ValueError(f"model {spec.name!r} is registered twice")
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


def build_model(name: str, seed: int = 0) -> nn.Sequential:
    """Build ``name`` with deterministic initial parameters."""
    spec = check_model_name(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
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
