"""A user's project, made by a test outside the repository: image files and a package of code
(``benchmarks.harness.userproject`` writes them; the data-loading benchmark makes the same project).

- ``write_mnist_pngs(root, n_train, n_val)``: the real MNIST split as grayscale PNG files in
  the ``imagefolder`` layout, ``root/train/<label>/<i>.png`` and ``root/val/<label>/<i>.png``.
- ``write_package(root, name, sources)``: a package ``name`` under ``root`` with the given
  modules (``{"data": "...source..."}`` makes ``name.data``), so ``root`` goes on a process's
  ``PYTHONPATH`` and nowhere else.
- ``PNG_DATASET``, ``BN_CNN``: sources of a user's modules (a ``Dataset`` of those PNG files,
  a CNN with BatchNorm).
- ``pythonpath(*dirs)``: a ``PYTHONPATH`` override for ``tests.procs`` (an override replaces the
  variable, so it names this checkout first, as ``tests.procs.env`` does).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from benchmarks.harness import userproject as _written
from benchmarks.harness.userproject import MNIST_TRAIN_SPLIT, PNG_DATASET, write_package
from tests.procs import MNIST_DIR, ROOT

__all__ = ["BN_CNN", "MNIST_TRAIN_SPLIT", "PNG_DATASET", "mnist_images", "pythonpath", "write_mnist_pngs",
           "write_package"]


def mnist_images(data_dir: Path = MNIST_DIR) -> tuple[np.ndarray, np.ndarray]:
    """``benchmarks.harness.userproject.mnist_images`` of the tests' MNIST split."""
    return _written.mnist_images(data_dir)


def write_mnist_pngs(root: Path, n_train: int, n_val: int, data_dir: Path = MNIST_DIR) -> Path:
    """``benchmarks.harness.userproject.write_mnist_pngs`` of the tests' MNIST split."""
    return _written.write_mnist_pngs(root, n_train, n_val, data_dir)


def pythonpath(*dirs: Path) -> str:
    """The ``PYTHONPATH`` of a child that imports this checkout and ``dirs``."""
    return os.pathsep.join([str(ROOT), *(str(d) for d in dirs)])


BN_CNN = '''
    """A user's CNN with BatchNorm (not an nn.Sequential), for 1x28x28 digits."""
    import torch.nn.functional as F
    from torch import nn


    class BNNet(nn.Module):
        def __init__(self, width: int = 32):
            super().__init__()
            self.conv1 = nn.Conv2d(1, width, 3)
            self.bn1 = nn.BatchNorm2d(width)
            self.conv2 = nn.Conv2d(width, 2 * width, 3)
            self.bn2 = nn.BatchNorm2d(2 * width)
            self.head = nn.Linear(2 * width * 5 * 5, 10)

        def forward(self, x):
            x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
            x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
            return self.head(x.flatten(1))
'''
"""Source of a user module (``write_package(root, "nets", {"cnn": BN_CNN})``): ``BNNet(width)``."""

