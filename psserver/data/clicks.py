"""A synthetic click log with a structure a recommendation model can learn (``--dataset
synthetic_clicks``), for tables of any size without a download.

Each sample has ``fields`` categorical ids and ``dense`` real features. A field's ids follow a
Zipf law over ``vocab`` ranks (a few ids are most of the traffic, most ids are rare, as in real
logs), and each rank is scattered to an id in ``[0, id_space)`` by a hash, so a 2^40 id space
is used sparsely and no dense table over it could be built. Every id has hidden factors and a
bias (a pure function of the id and the seed), and the click probability is a logistic model
of the pairwise interactions of the sample's fields' factors, their biases and the dense
features: what a factorisation machine or a DLRM can recover, and an id seen too rarely to be
learnt costs accuracy, as in a real log.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import TensorDataset

from psserver.utils.eval_metrics import auc  # re-exported: it lived here first
from psserver.utils.hashing import mix64, normal_by_id


@dataclass(frozen=True)
class ClickLogSpec:
    fields: int = 4
    dense: int = 4
    vocab: int = 20_000
    """Distinct ids per field that occur (their Zipf ranks)."""
    id_space: int = 1 << 40
    zipf: float = 1.05
    factors: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        if self.fields < 1 or self.dense < 0 or self.vocab < 1 or self.factors < 1:
            raise ValueError("a click log needs >= 1 field, >= 0 dense features, >= 1 id per field and factor")
        if not 1 <= self.vocab <= self.id_space <= 2**62:
            raise ValueError(f"the id space ({self.id_space}) must hold the vocabulary ({self.vocab}) and be <= 2^62")
        if self.zipf <= 0:
            raise ValueError("the Zipf exponent must be > 0")


def field_ids(spec: ClickLogSpec, field: int, ranks: torch.Tensor) -> torch.Tensor:
    """The ids of ``ranks`` (0-based) of ``field``, scattered over the id space."""
    return mix64(ranks.to(torch.int64) * 1_000_003 + field * 7919 + spec.seed).remainder(spec.id_space)


def make_click_log(spec: ClickLogSpec, n: int, *, sample_seed: int) -> TensorDataset:
    """``n`` samples: ``(ids [n, fields] int64, dense [n, dense] float32, click [n] float32)``."""
    g = torch.Generator().manual_seed(sample_seed)
    weights = 1.0 / torch.arange(1, spec.vocab + 1, dtype=torch.float64) ** spec.zipf
    ids = torch.stack([field_ids(spec, f, torch.multinomial(weights, n, replacement=True, generator=g))
                       for f in range(spec.fields)], dim=1)
    dense = torch.randn(n, spec.dense, generator=g)
    logit = click_logit(spec, ids, dense)
    click = (torch.rand(n, generator=g, dtype=torch.float64) < torch.sigmoid(logit.double())).float()
    return TensorDataset(ids, dense, click)


def click_logit(spec: ClickLogSpec, ids: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """The hidden model's logit: pairwise factor interactions, id biases, a dense part."""
    n, fields = ids.shape
    factors = normal_by_id(ids.reshape(-1), spec.factors, salt=spec.seed + 1).view(n, fields, spec.factors)
    bias = normal_by_id(ids.reshape(-1), 1, salt=spec.seed + 2).view(n, fields)
    pairs = (factors.sum(1).pow(2).sum(1) - factors.pow(2).sum((1, 2))) / 2  # sum over field pairs of <z_i, z_j>
    w_dense = normal_by_id(torch.arange(spec.dense), 1, salt=spec.seed + 3).view(-1)
    scale = 1.0 / max(1.0, (fields * (fields - 1) / 2) ** 0.5)
    # Weights chosen so that the hidden model itself scores an AUC of about 0.89 on held-out
    # samples (the ceiling of any learnt model) at a click rate of about 0.4.
    return 2.5 * scale * pairs / spec.factors ** 0.5 + 0.8 * bias.sum(1) / fields ** 0.5 + \
        0.5 * dense @ w_dense / max(1, spec.dense) ** 0.5 - 0.5


def make_synthetic_clicks(spec: ClickLogSpec, n_train: int, n_eval: int) -> tuple[TensorDataset, TensorDataset]:
    """Train and held-out splits, drawn independently from the same hidden model."""
    return make_click_log(spec, n_train, sample_seed=spec.seed), make_click_log(spec, n_eval, sample_seed=spec.seed + 1)


__all__ = ["ClickLogSpec", "auc", "click_logit", "field_ids", "make_click_log", "make_synthetic_clicks"]
