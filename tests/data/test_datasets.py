import gzip
import struct

import numpy as np
import pytest

from psserver.config import DataConfig
from psserver.data import load_dataset
from psserver.data.idx import load_mnist, read_idx
from psserver.data.synthetic import make_synthetic


def write_idx(path, arr: np.ndarray, compress=True):
    header = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if compress else data)


def test_reads_idx_gz_and_plain(tmp_path):
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    write_idx(tmp_path / "a.gz", arr)
    write_idx(tmp_path / "b", arr, compress=False)
    assert (read_idx(tmp_path / "a.gz") == arr).all()
    assert (read_idx(tmp_path / "b") == arr).all()


def test_truncated_idx_is_reported(tmp_path):
    arr = np.zeros((10, 28, 28), dtype=np.uint8)
    write_idx(tmp_path / "x", arr, compress=False)
    data = (tmp_path / "x").read_bytes()
    (tmp_path / "x").write_bytes(data[:-50])
    with pytest.raises(ValueError, match="truncated"):
        read_idx(tmp_path / "x")
    (tmp_path / "y").write_bytes(b"hello world")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "y")


def test_single_split_needs_train_split(tmp_path):
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", np.zeros((20, 28, 28)))
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.arange(20) % 10)
    with pytest.raises(ValueError, match="--train-split"):
        load_mnist(tmp_path)
    train, test = load_mnist(tmp_path, train_split=15)
    assert len(train) == 15 and len(test) == 5
    assert train.tensors[0].shape == (15, 1, 28, 28)


def test_real_mnist_split(mnist_dir):
    train, test = load_dataset(DataConfig(dataset="mnist", data_dir=mnist_dir, train_split=8000), (1, 28, 28), 10)
    assert len(train) == 8000 and len(test) == 2000
    assert set(train.tensors[1].unique().tolist()) == set(range(10))


def test_shape_mismatch_is_one_line(mnist_dir):
    with pytest.raises(ValueError, match=r"samples of shape \(1, 28, 28\), the model expects \(3, 32, 32\)"):
        load_dataset(DataConfig(dataset="mnist", data_dir=mnist_dir, train_split=8000), (3, 32, 32), 10)


def test_synthetic_is_deterministic_and_balanced():
    a, _ = make_synthetic((1, 28, 28), 10, 500, 100, seed=1)
    b, _ = make_synthetic((1, 28, 28), 10, 500, 100, seed=1)
    assert (a.tensors[0] == b.tensors[0]).all()
    assert len(a.tensors[1].unique()) == 10


def test_unknown_dataset_and_missing_dir(tmp_path):
    with pytest.raises(ValueError, match="unknown dataset"):
        DataConfig(dataset="cifar")
    with pytest.raises(ValueError, match="does not exist"):
        DataConfig(dataset="mnist", data_dir=tmp_path / "nope")


def test_data_errors_are_usage_errors(tmp_path):
    # The CLI reports them as one line with exit code 2 (and they stay ValueErrors).
    from psserver.errors import DataError, UsageError

    with pytest.raises(UsageError, match="no MNIST IDX files") as e:
        load_mnist(tmp_path)
    assert isinstance(e.value, DataError) and isinstance(e.value, ValueError)
