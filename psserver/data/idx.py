"""MNIST in its original IDX format (``*-idx3-ubyte[.gz]``), the files torchvision downloads."""

from __future__ import annotations

import gzip
import logging
import struct
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

from psserver.errors import DataError

log = logging.getLogger(__name__)

# torchvision's normalisation constants for MNIST.
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file, gzip-compressed or not; ``DataError`` (a ``ValueError``) if it is not one."""
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read {path}: {e}") from None
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _DTYPES:
        raise DataError(f"{path} is not an IDX file")
    ndim = data[3]
    header = 4 + 4 * ndim
    shape = struct.unpack(f">{ndim}I", data[4:header])
    arr = np.frombuffer(data, dtype=_DTYPES[data[2]], offset=header)
    if arr.size != int(np.prod(shape)):
        raise DataError(f"{path} is truncated: expected {int(np.prod(shape))} items, found {arr.size}")
    return arr.reshape(shape)


def _find(data_dir: Path, stem: str) -> Path | None:
    for name in (f"{stem}.gz", stem):
        for candidate in (data_dir / name, data_dir / "MNIST" / "raw" / name):
            if candidate.is_file():
                return candidate
    return None


def _load_split(data_dir: Path, prefix: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    images = _find(data_dir, f"{prefix}-images-idx3-ubyte")
    labels = _find(data_dir, f"{prefix}-labels-idx1-ubyte")
    if images is None or labels is None:
        return None
    x = read_idx(images)
    y = read_idx(labels)
    if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
        raise DataError(f"{images} and {labels} do not match")
    xt = torch.from_numpy(x.astype(np.float32) / 255.0).sub_(MNIST_MEAN).div_(MNIST_STD).unsqueeze(1)
    return xt, torch.from_numpy(y.astype(np.int64))


def load_mnist(
    data_dir: Path, train_split: int | None = None, download: bool = False
) -> tuple[TensorDataset, TensorDataset]:
    """Train and eval sets from ``data_dir``.

    With both splits present, ``train-*`` trains and ``t10k-*`` evaluates. With ``train_split``
    (or when only the test split exists, as in ``../shared/data/mnist``) the first
    ``train_split`` images of the one split train and the rest evaluate.
    """
    data_dir = Path(data_dir)
    if download:
        _download(data_dir)
    if not data_dir.is_dir():
        raise DataError(f"data directory {data_dir} does not exist (use --download where a network exists)")
    train = _load_split(data_dir, "train")
    test = _load_split(data_dir, "t10k")
    if train is not None and test is not None and train_split is None:
        return TensorDataset(*train), TensorDataset(*test)
    only = test if test is not None else train
    if only is None:
        raise DataError(f"no MNIST IDX files (*-idx3-ubyte[.gz]) in {data_dir}")
    if train_split is None:
        raise DataError(f"{data_dir} holds only one MNIST split: pass --train-split N to divide it")
    x, y = only
    if not 0 < train_split < len(x):
        raise DataError(f"--train-split {train_split} must be between 1 and {len(x) - 1}")
    log.info("mnist: %d training and %d evaluation images from %s", train_split, len(x) - train_split, data_dir)
    return TensorDataset(x[:train_split], y[:train_split]), TensorDataset(x[train_split:], y[train_split:])


def _download(data_dir: Path) -> None:
    from torchvision.datasets import MNIST

    try:
        for train in (True, False):
            MNIST(str(data_dir), train=train, download=True)
    except Exception as e:  # noqa: BLE001 - any network failure is one line for the user
        raise DataError(f"cannot download MNIST into {data_dir}: {e}") from None
