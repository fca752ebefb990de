"""Datasets by name. Each returns ``(train, eval)`` as in-memory ``TensorDataset``s.

Data is small here (MNIST is 47 MB as float32), so tensors in memory beat a DataLoader with
worker processes on a 2-core machine.

Classification datasets (``mnist``, ``synthetic``) hold ``(x, label)``; recommendation datasets
(``movielens100k``, ``synthetic_clicks``) hold ``(ids [n, columns] int64, dense [n, k] float32,
target [n] float32)``, for a model with embedding tables on the servers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.utils.data import TensorDataset

from psserver.data.clicks import ClickLogSpec, make_synthetic_clicks
from psserver.data.idx import load_mnist
from psserver.data.movielens import load_movielens100k
from psserver.data.synthetic import make_synthetic
from psserver.errors import DataError

log = logging.getLogger(__name__)

DATASETS: dict[str, Callable[..., tuple[TensorDataset, TensorDataset]]] = {
    "mnist": load_mnist,
    "synthetic": make_synthetic,
    "movielens100k": load_movielens100k,
    "synthetic_clicks": make_synthetic_clicks,
}

SPARSE_DATASETS = frozenset({"movielens100k", "synthetic_clicks"})
"""Datasets of ids for a model with embedding tables (the rest are classification data)."""

GENERATED_SIZES: dict[str, tuple[int, int]] = {
    "synthetic": (4096, 1024),
    "synthetic_clicks": (200_000, 20_000),
}
"""Train and eval sizes of the generated datasets when the config leaves them None."""

MOVIELENS_SEED = 0
"""The MovieLens split is fixed whatever ``--data-seed`` says: RMSE figures are comparable
only on the same held-out ratings."""


def generated_sizes(config) -> tuple[int, int]:
    """The train and eval sizes ``config`` asks of a generated dataset (its defaults for None)."""
    n_train, n_eval = GENERATED_SIZES[config.dataset]
    train = config.synthetic_train if config.synthetic_train is not None else n_train
    held_out = config.synthetic_eval if config.synthetic_eval is not None else n_eval
    return train, held_out


def load_dataset(config, input_shape: tuple[int, ...] | None, num_classes: int | None, input_dtype=None):
    """Build the train and eval splits that ``config`` (a ``DataConfig``) names, for a model of
    ``input_shape`` and ``num_classes`` (None: a user's model, which does not say).

    Raises ``DataError`` (a usage error and a ``ValueError``) with one readable line when the
    data does not exist or does not fit the model's input.
    """
    if input_shape is None and config.dataset != "mnist":
        raise DataError(f"--dataset {config.dataset} is made for psserver's own models (it needs to know the model's "
                        "input); for your own model use --dataset mnist or MODULE:ATTR")
    if config.dataset in SPARSE_DATASETS:
        return _load_sparse(config, tuple(input_shape), input_dtype)
    if config.dataset == "mnist":
        train, test = load_mnist(config.data_dir, train_split=config.train_split, download=config.download)
        sample_shape = tuple(train.tensors[0].shape[1:])
        if input_shape is not None and sample_shape != tuple(input_shape):
            raise DataError(
                f"dataset mnist has samples of shape {sample_shape}, the model expects {tuple(input_shape)}"
            )
        return train, test
    if num_classes is None or num_classes < 2:
        # A single output is a recommendation model's (a rating or a click logit): synthetic
        # labels of one class would train it on nothing.
        raise DataError(f"dataset {config.dataset} is a classification task, the model has a single output "
                        "(a recommendation model: use --dataset movielens100k or synthetic_clicks)")
    n_train, n_eval = generated_sizes(config)
    return make_synthetic(
        input_shape,
        num_classes,
        n_train=n_train,
        n_eval=n_eval,
        seed=config.seed,
        input_dtype=input_dtype,
    )


def _load_sparse(config, input_shape: tuple[int, ...], input_dtype) -> tuple[TensorDataset, TensorDataset]:
    """A recommendation dataset, checked against a model's input: a row of integer ids."""
    dtype = input_dtype if input_dtype is not None else torch.float32
    if len(input_shape) != 1 or dtype.is_floating_point:
        raise DataError(f"dataset {config.dataset} holds rows of integer ids for a model with embedding tables, "
                        f"the model expects {str(dtype).removeprefix('torch.')} samples of shape {input_shape} "
                        f"({_HINT})")
    if config.dataset == "movielens100k":
        train, held_out = load_movielens100k(seed=MOVIELENS_SEED)
    else:
        n_train, n_eval = generated_sizes(config)
        spec = ClickLogSpec(vocab=config.click_vocab, id_space=config.id_space, seed=config.seed)
        train, held_out = make_synthetic_clicks(spec, n_train, n_eval)
    columns = train.tensors[0].shape[1]
    if columns != input_shape[0]:
        raise DataError(f"dataset {config.dataset} has {columns} id columns, the model expects {input_shape[0]} "
                        f"({_HINT})")
    log.info("dataset %s: %d train and %d held-out samples of %d ids", config.dataset, len(train), len(held_out),
             columns)
    return train, held_out


_HINT = "movielens100k is for --model mf, synthetic_clicks for --model dlrm_tiny"


__all__ = [
    "DATASETS",
    "GENERATED_SIZES",
    "SPARSE_DATASETS",
    "generated_sizes",
    "load_dataset",
    "load_mnist",
    "load_movielens100k",
    "make_synthetic",
    "make_synthetic_clicks",
]
