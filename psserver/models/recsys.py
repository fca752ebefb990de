"""Recommendation models whose embedding tables live on the parameter servers.

Each module here is the model's dense part only: ``forward(rows, dense)`` receives, per table,
the rows the servers looked up for each sample (``[batch, dim + extra_dims]``) and the dense
features (``[batch, dense_features]``), and returns one output per sample. ``penalty(rows)``
is a regulariser the trainer adds to the loss: it needs the rows, which only the trainer has.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor, nn

from psserver.models.registry import ModelSpec, TableDef, check_spec

log = logging.getLogger(__name__)


def _check_rows(rows: list[Tensor], widths: list[int], model: str) -> None:
    """A readable error for rows that do not fit, rather than a shape error deep in a matmul."""
    got = [tuple(r.shape) for r in rows]
    if len(rows) != len(widths) or any(r.dim() != 2 or r.shape[1] != w for r, w in zip(rows, widths, strict=True)):
        raise ValueError(f"{model} takes {len(widths)} tables of rows [batch, {widths}], got {got}")


class RatingRange(nn.Module):
    """Clamps predictions to the rating scale at evaluation only: clamping while training
    would zero the gradient of every prediction outside it."""

    def __init__(self, low: float, high: float) -> None:
        super().__init__()
        if not low < high:
            raise ValueError(f"rating range ({low}, {high}) is empty")
        self.low, self.high = float(low), float(high)

    def forward(self, x: Tensor) -> Tensor:
        return x if self.training else x.clamp(self.low, self.high)

    def extra_repr(self) -> str:
        return f"low={self.low}, high={self.high}"


class MatrixFactorization(nn.Module):
    """Biased matrix factorisation: ``mu + b_u + b_i + <p_u, q_i>``. A user's row is
    ``[p_u, b_u]`` and an item's ``[q_i, b_i]``: the biases live in the tables with the
    factors, so the servers update them sparsely too; only the global mean is dense."""

    def __init__(self, dim: int, rating_range: tuple[float, float] = (1.0, 5.0), l2: float = 0.05,
                 mean: float = 3.5) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"embedding dim must be >= 1, got {dim}")
        self.dim, self.l2 = dim, l2
        self.mu = nn.Parameter(torch.tensor(float(mean)))
        self.range = RatingRange(*rating_range)

    def forward(self, rows: list[Tensor], dense: Tensor | None = None) -> Tensor:
        _check_rows(rows, [self.dim + 1, self.dim + 1], "mf")
        user, item = rows
        dot = (user[:, : self.dim] * item[:, : self.dim]).sum(1)
        return self.range(self.mu + user[:, self.dim] + item[:, self.dim] + dot)

    def penalty(self, rows: list[Tensor]) -> Tensor:
        """L2 on the rows a batch used (factors and biases), per sample: rare ids are pulled
        to zero as often as they appear, the usual SGD form for sparse factorisation."""
        return self.l2 * torch.stack([r.pow(2).sum(1).mean() for r in rows]).sum()


class TinyDLRM(nn.Module):
    """A small DLRM: a bottom MLP over the dense features, the pairwise dot products of it and
    the tables' rows, and a top MLP over those and the bottom output, giving a click logit."""

    def __init__(self, dim: int, tables: int = 4, dense_features: int = 4, bottom_hidden: int = 32,
                 top_hidden: int = 64) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"embedding dim must be >= 1, got {dim}")
        self.dim, self.tables = dim, tables
        self.bottom = nn.Sequential(nn.Linear(dense_features, bottom_hidden), nn.ReLU(), nn.Linear(bottom_hidden, dim))
        vectors = tables + 1
        self.pairs = vectors * (vectors - 1) // 2
        self.top = nn.Sequential(nn.Linear(dim + self.pairs, top_hidden), nn.ReLU(), nn.Linear(top_hidden, 1))

    def forward(self, rows: list[Tensor], dense: Tensor) -> Tensor:
        _check_rows(rows, [self.dim] * self.tables, "dlrm_tiny")
        x = self.bottom(dense)
        vectors = torch.stack([x, *rows], dim=1)  # [B, tables + 1, dim]
        dots = vectors @ vectors.transpose(1, 2)
        i, j = torch.triu_indices(self.tables + 1, self.tables + 1, offset=1, device=dots.device)
        return self.top(torch.cat([x, dots[:, i, j]], dim=1)).squeeze(1)

    def penalty(self, rows: list[Tensor]) -> Tensor:
        """None: the optimizer's weight decay is the only regulariser."""
        return self.top[0].weight.new_zeros(())


def mf(dim: int) -> MatrixFactorization:
    return MatrixFactorization(dim)


def dlrm_tiny(dim: int) -> TinyDLRM:
    return TinyDLRM(dim)


MF = check_spec(ModelSpec(
    "mf", mf, (2,), 1,
    "biased matrix factorisation for MovieLens ratings (user, item ids; mu + b_u + b_i + <p_u, q_i>)",
    input_dtype=torch.long,
    tables=(TableDef("user", 0, 1), TableDef("item", 1, 1)),
    embedding_dim=32,
    dense_features=0,
    loss="mse",
    metric="rmse",
))
DLRM_TINY = check_spec(ModelSpec(
    "dlrm_tiny", dlrm_tiny, (4,), 1,
    "small DLRM for click logs (4 id fields, 4 dense features; dot interactions, MLPs)",
    input_dtype=torch.long,
    tables=tuple(TableDef(f"c{i}", i) for i in range(4)),
    embedding_dim=16,
    dense_features=4,
    loss="bce",
    metric="auc",
))
