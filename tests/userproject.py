"""A user's project, made by a test outside the repository: image files and a package of code.

- ``write_mnist_pngs(root, n_train, n_val)``: the real MNIST split as grayscale PNG files in
  the ``imagefolder`` layout, ``root/train/<label>/<i>.png`` and ``root/val/<label>/<i>.png``.
- ``write_package(root, name, sources)``: a package ``name`` under ``root`` with the given
  modules (``{"data": "...source..."}`` makes ``name.data``), so ``root`` goes on a process's
  ``PYTHONPATH`` and nowhere else.
- ``pythonpath(*dirs)``: a ``PYTHONPATH`` override for ``tests.procs`` (an override replaces the
  variable, so it names this checkout first, as ``tests.procs.env`` does).
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import numpy as np

from tests.procs import MNIST_DIR, ROOT

MNIST_TRAIN_SPLIT = 8000
"""The split ``tests.procs.MNIST_ARGS`` trains on: images below it train, the rest are held out."""


def mnist_images(data_dir: Path = MNIST_DIR) -> tuple[np.ndarray, np.ndarray]:
    """The images of the MNIST split in ``data_dir`` as uint8 ``[n, 28, 28]`` and their labels
    (``psserver.data.idx.load_mnist``'s normalisation undone, exactly: pixels are k / 255)."""
    from psserver.data.idx import MNIST_MEAN, MNIST_STD, load_mnist

    train, held_out = load_mnist(data_dir, train_split=MNIST_TRAIN_SPLIT)
    x = np.concatenate([train.tensors[0].numpy(), held_out.tensors[0].numpy()])[:, 0]
    y = np.concatenate([train.tensors[1].numpy(), held_out.tensors[1].numpy()])
    pixels = np.rint((x * MNIST_STD + MNIST_MEAN) * 255.0).clip(0, 255).astype(np.uint8)
    return pixels, y


def write_mnist_pngs(root: Path, n_train: int, n_val: int, data_dir: Path = MNIST_DIR) -> Path:
    """``root/train/<label>/<i>.png`` for the first ``n_train`` images of the split and
    ``root/val/<label>/<i>.png`` for ``n_val`` images from its held-out part (index
    ``MNIST_TRAIN_SPLIT`` on), as 28x28 grayscale (mode ``L``) PNGs; returns ``root``."""
    from PIL import Image

    pixels, labels = mnist_images(data_dir)
    if n_train > MNIST_TRAIN_SPLIT or n_val > len(pixels) - MNIST_TRAIN_SPLIT:
        raise ValueError(f"at most {MNIST_TRAIN_SPLIT} training and {len(pixels) - MNIST_TRAIN_SPLIT} held-out images")
    root = Path(root)
    for split, indices in (("train", range(n_train)), ("val", range(MNIST_TRAIN_SPLIT, MNIST_TRAIN_SPLIT + n_val))):
        for label in range(10):
            (root / split / str(label)).mkdir(parents=True, exist_ok=True)
        for i in indices:
            Image.fromarray(pixels[i], mode="L").save(root / split / str(int(labels[i])) / f"{i}.png")
    return root


def write_package(root: Path, name: str, sources: dict[str, str]) -> Path:
    """A package ``name`` under ``root``: ``sources`` maps module names to their source
    (dedented; ``__init__`` may be among them, else it is empty). Returns ``root``, the
    directory that goes on ``PYTHONPATH``."""
    package = Path(root) / name
    package.mkdir(parents=True, exist_ok=True)
    if "__init__" not in sources:
        (package / "__init__.py").write_text("")
    for module, source in sources.items():
        (package / f"{module}.py").write_text(textwrap.dedent(source))
    return Path(root)


def pythonpath(*dirs: Path) -> str:
    """The ``PYTHONPATH`` of a child that imports this checkout and ``dirs``."""
    return os.pathsep.join([str(ROOT), *(str(d) for d in dirs)])


PNG_DATASET = '''
    """A user's own Dataset: PNG files of an image folder, read with PIL, nothing of psserver."""

    from pathlib import Path

    import numpy as np
    import torch
    from PIL import Image
    from torch.utils.data import Dataset


    class PngDigits(Dataset):
        def __init__(self, root, split="train"):
            self.files = sorted(Path(root, split).glob("*/*.png"))
            self.labels = [int(f.parent.name) for f in self.files]

        def __len__(self):
            return len(self.files)

        def __getitem__(self, i):
            with Image.open(self.files[i]) as image:
                x = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0)
            return ((x - 0.1307) / 0.3081).unsqueeze(0), self.labels[i]


    def splits(root):
        return PngDigits(root, "train"), PngDigits(root, "val")
'''
"""Source of a user module (``write_package(root, "digits", {"data": PNG_DATASET})``): a
``Dataset`` class ``PngDigits(root, split)`` and ``splits(root)``, its train and val pair."""


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

