"""Datasets by name or by reference, and the batches a trainer reads from them.

The built-in sets return ``(train, eval)`` as in-memory ``TensorDataset``s: data is small here
(MNIST is 47 MB as float32), and a ``TensorDataset`` is read a whole batch at a time
(``psserver.data.loader``). Classification datasets (``mnist``, ``synthetic``) hold ``(x,
label)``; recommendation datasets (``movielens100k``, ``synthetic_clicks``) hold ``(ids [n,
columns] int64, dense [n, k] float32, target [n] float32)``, for a model with embedding tables
on the servers (the input of a sample is then ``(ids, dense)``).

``pysource`` is next-byte prediction on the Python standard library's sources
(``psserver.data.text``). ``imagefolder`` reads images on disk (``psserver.data.imagefolder``); ``MODULE:ATTR`` is a
user's ``Dataset`` (``psserver.data.reference``), map-style or iterable; an
``IterableDataset`` shards itself with :func:`shard_info`.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset

from psserver.data.clicks import ClickLogSpec, make_synthetic_clicks
from psserver.data.idx import load_mnist
from psserver.data.loader import Batches, ShardInfo, check_batch, check_sample, check_samples, shard_info
from psserver.data.movielens import load_movielens100k
from psserver.data.reference import check_dataset_reference, load_user_dataset
from psserver.data.synthetic import make_synthetic
from psserver.data.text import load_pysource
from psserver.errors import DataError, first_line
from psserver.utils.memory import available_memory
from psserver.utils.references import is_reference
from psserver.utils.units import human_bytes

log = logging.getLogger(__name__)

DATASETS: dict[str, Callable[..., tuple[TensorDataset, TensorDataset]]] = {
    "mnist": load_mnist,
    "synthetic": make_synthetic,
    "movielens100k": load_movielens100k,
    "synthetic_clicks": make_synthetic_clicks,
    "pysource": load_pysource,
}

IMAGEFOLDER = "imagefolder"
"""``--dataset imagefolder --data-dir DIR``: ``DIR/train/<class>/<image>``, ``DIR/val/...``."""

IN_MEMORY_WORKERS = 0
"""DataLoader workers of the built-in in-memory sets by default: a batch is one gather from
tensors in memory, which a worker process would only copy through shared memory."""
FILE_WORKERS = 1
"""DataLoader workers of data read from files or a user's code by default (imagefolder,
``MODULE:ATTR``): one process loads and decodes the next batches while the trainer's thread
computes and exchanges with the server, which hides loading that takes less than a step
(more only help when one worker cannot keep up: ``--data-workers``)."""

SPARSE_DATASETS = frozenset({"movielens100k", "synthetic_clicks"})
"""Datasets of ids for a model with embedding tables (the rest are classification data)."""

GENERATED_SIZES: dict[str, tuple[int, int]] = {
    "synthetic": (4096, 1024),
    "synthetic_clicks": (200_000, 20_000),
    "pysource": (32_768, 512),
}
"""Train and eval sizes of the generated datasets (and of ``pysource``'s samples) when the config
leaves them None."""

MOVIELENS_SEED = 0
"""The MovieLens split is fixed whatever ``--data-seed`` says: RMSE figures are comparable
only on the same held-out ratings."""


def generated_sizes(config) -> tuple[int, int]:
    """The train and eval sizes ``config`` asks of a generated dataset (its defaults for None)."""
    n_train, n_eval = GENERATED_SIZES[config.dataset]
    train = config.synthetic_train if config.synthetic_train is not None else n_train
    held_out = config.synthetic_eval if config.synthetic_eval is not None else n_eval
    return train, held_out


def is_builtin(dataset: str) -> bool:
    """Whether ``--dataset`` names one of the in-memory built-in sets."""
    return dataset in DATASETS


def check_dataset(config) -> None:
    """What can be checked of ``config``'s dataset (a ``DataConfig``) before a trainer starts:
    a name it knows, a reference that resolves with its arguments, an image folder's layout.
    ``ValueError`` of one line otherwise."""
    if is_reference(config.dataset):
        check_dataset_reference(config.dataset, config.dataset_args)
        return
    if config.dataset_args:
        raise DataError(f"--dataset-args applies to --dataset MODULE:ATTR, not to --dataset {config.dataset}")
    if config.dataset == IMAGEFOLDER:
        from psserver.data.imagefolder import check_layout

        check_layout(config.data_dir)
        return
    if config.dataset not in DATASETS:
        raise DataError(f"unknown dataset {config.dataset!r}; known: {', '.join(dataset_names())} (or MODULE:ATTR, "
                        "a Dataset or a function returning one)")


def dataset_names() -> list[str]:
    """What ``--dataset`` takes besides ``MODULE:ATTR``."""
    return sorted([*DATASETS, IMAGEFOLDER])


def default_workers(config) -> int:
    """DataLoader workers of ``config``'s dataset when ``--data-workers`` is not given."""
    return IN_MEMORY_WORKERS if is_builtin(config.dataset) else FILE_WORKERS


def load_dataset(config, input_shape: tuple[int, ...] | None, num_classes: int | None,
                 input_dtype=None) -> tuple[Dataset, Dataset | None]:
    """Build the train and held-out splits that ``config`` (a ``DataConfig``) names, for a
    model of ``input_shape`` and ``num_classes`` (None: a user's model, which does not say).
    The built-in sets are ``TensorDataset``s; the held-out split is None when a user's dataset
    or an image folder has none.

    Raises ``DataError`` (a usage error and a ``ValueError``) with one readable line when the
    data does not exist or does not fit the model's input.
    """
    if is_reference(config.dataset) or config.dataset == IMAGEFOLDER:
        if is_reference(config.dataset):
            train, held_out = load_user_dataset(config.dataset, config.dataset_args)
        else:
            from psserver.data.imagefolder import load_imagefolder

            train, held_out = load_imagefolder(config.data_dir, config.image_size)
        _check_fit(config.dataset, train, input_shape, num_classes)
        return train, held_out
    if input_shape is None and config.dataset != "mnist":
        raise DataError(f"--dataset {config.dataset} is made for psserver's own models (it needs to know the model's "
                        "input); for your own model use --dataset mnist or MODULE:ATTR")
    if config.dataset in SPARSE_DATASETS:
        return _load_sparse(config, tuple(input_shape), input_dtype)
    if config.dataset == "pysource":
        if len(input_shape) != 1 or input_dtype is None or input_dtype.is_floating_point or num_classes != 256:
            raise DataError("dataset pysource holds sequences of bytes for a byte-level language model (byte_lm), "
                            f"not for a model of input {tuple(input_shape)} and {num_classes} outputs")
        n_train, n_eval = generated_sizes(config)
        return load_pysource(input_shape[0], n_train, n_eval)
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
    tokens = input_dtype is not None and not input_dtype.is_floating_point
    _check_generated_size(config, (math.prod(input_shape) * (8 if tokens else 4)) + 8)
    with _generating(config):
        return make_synthetic(
            input_shape,
            num_classes,
            n_train=n_train,
            n_eval=n_eval,
            seed=config.seed,
            input_dtype=input_dtype,
        )


def _check_generated_size(config, sample_bytes: int) -> None:
    """``DataError`` naming ``--train-samples``/``--eval-samples`` when the generated dataset they
    ask for (``sample_bytes`` a sample) is more than this process may still allocate: it is
    made in memory, and 1e14 samples failed to allocate deep in torch (an internal error)."""
    n_train, n_eval = generated_sizes(config)
    need, have = (n_train + n_eval) * sample_bytes, available_memory()
    if need > have:
        raise DataError(f"{_size_flags(config)}: the generated {config.dataset} dataset ({n_train + n_eval} samples "
                        f"of {sample_bytes} bytes) needs {human_bytes(need)} of memory; {human_bytes(have)} is "
                        "available here")


@contextlib.contextmanager
def _generating(config) -> Iterator[None]:
    """An allocation that fails while a dataset is generated anyway (the memory went elsewhere
    meanwhile, or the generation's temporaries did not fit) is one line naming the sizes."""
    try:
        yield
    except (MemoryError, RuntimeError) as e:
        if not isinstance(e, MemoryError | torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        raise DataError(f"{_size_flags(config)}: generating dataset {config.dataset} ran out of memory "
                        f"({first_line(e)})") from None


def _size_flags(config) -> str:
    """The flags that set a generated dataset's size, as given (its defaults when none was)."""
    given = [f"{flag} {n}" for flag, n in (("--train-samples", config.synthetic_train),
                                          ("--eval-samples", config.synthetic_eval)) if n is not None]
    return " ".join(given) or f"dataset {config.dataset} (its default sizes)"


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
        _check_generated_size(config, spec.fields * 8 + spec.dense * 4 + 4)  # int64 ids, float32 dense and click
        with _generating(config):
            train, held_out = make_synthetic_clicks(spec, n_train, n_eval)
    columns = train.tensors[0].shape[1]
    if columns != input_shape[0]:
        raise DataError(f"dataset {config.dataset} has {columns} id columns, the model expects {input_shape[0]} "
                        f"({_HINT})")
    log.info("dataset %s: %d train and %d held-out samples of %d ids", config.dataset, len(train), len(held_out),
             columns)
    return train, held_out


def _check_fit(name: str, train: Dataset, input_shape: tuple[int, ...] | None, num_classes: int | None) -> None:
    """For psserver's own models (which say what they take): the first sample's input shape
    and, for an image folder, its number of classes. A user's model is checked by its first
    step instead (``psserver.trainer.loop``)."""
    if input_shape is None or isinstance(train, IterableDataset):
        return
    x = train[0][0]
    if isinstance(x, torch.Tensor) and tuple(x.shape) != tuple(input_shape):
        hint = " (--image-size N resizes images)" if name == IMAGEFOLDER else ""
        raise DataError(f"dataset {name} has samples of shape {tuple(x.shape)}, the model expects "
                        f"{tuple(input_shape)}{hint}")
    classes = getattr(train, "classes", None)
    if name == IMAGEFOLDER and classes is not None and num_classes is not None and len(classes) > num_classes:
        raise DataError(f"dataset {name} has {len(classes)} classes, the model has {num_classes} outputs")


_HINT = "movielens100k is for --model mf, synthetic_clicks for --model dlrm_tiny"


__all__ = [
    "DATASETS",
    "FILE_WORKERS",
    "GENERATED_SIZES",
    "IMAGEFOLDER",
    "IN_MEMORY_WORKERS",
    "SPARSE_DATASETS",
    "Batches",
    "ClickLogSpec",
    "ShardInfo",
    "check_batch",
    "check_dataset",
    "check_sample",
    "check_samples",
    "dataset_names",
    "default_workers",
    "generated_sizes",
    "is_builtin",
    "load_dataset",
    "load_mnist",
    "load_movielens100k",
    "make_synthetic",
    "make_synthetic_clicks",
    "shard_info",
]
