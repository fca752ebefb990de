"""Datasets by name. Each returns ``(train, eval)`` as in-memory ``TensorDataset``s.

Data is small here (MNIST is 47 MB as float32), so tensors in memory beat a DataLoader with
worker processes on a 2-core machine.
"""

from __future__ import annotations

from collections.abc import Callable

from torch.utils.data import TensorDataset

from psserver.data.idx import load_mnist
from psserver.data.synthetic import make_synthetic
from psserver.errors import DataError

DATASETS: dict[str, Callable[..., tuple[TensorDataset, TensorDataset]]] = {
    "mnist": load_mnist,
    "synthetic": make_synthetic,
}


def load_dataset(config, input_shape: tuple[int, ...], num_classes: int, input_dtype=None):
    """Build the train and eval splits that ``config`` (a ``DataConfig``) names.

    Raises ``DataError`` (a usage error and a ``ValueError``) with one readable line when the
    data does not exist or does not fit the model's input.
    """
    if config.dataset == "mnist":
        train, test = load_mnist(config.data_dir, train_split=config.train_split, download=config.download)
        sample_shape = tuple(train.tensors[0].shape[1:])
        if sample_shape != tuple(input_shape):
            raise DataError(
                f"dataset mnist has samples of shape {sample_shape}, the model expects {tuple(input_shape)}"
            )
        return train, test
    return make_synthetic(
        input_shape,
        num_classes,
        n_train=config.synthetic_train,
        n_eval=config.synthetic_eval,
        seed=config.seed,
        input_dtype=input_dtype,
    )


__all__ = ["DATASETS", "load_dataset", "load_mnist", "make_synthetic"]
