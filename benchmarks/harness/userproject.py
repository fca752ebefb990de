"""A user's project written to disk, as the data-loading benchmark and the tests make one:
image files and a package of code that only the trainers' ``PYTHONPATH`` names.

- ``write_mnist_pngs(root, n_train, n_val, data_dir)``: the MNIST split in ``data_dir`` as
  grayscale PNG files in the ``imagefolder`` layout, ``root/train/<label>/<i>.png`` and
  ``root/val/<label>/<i>.png``.
- ``write_package(root, name, sources)``: a package ``name`` under ``root`` with the given
  modules (``{"data": "...source..."}`` makes ``name.data``), so ``root`` goes on a process's
  ``PYTHONPATH`` and nowhere else.
- ``PNG_DATASET``: the source of a user's ``Dataset`` that reads those PNG files with PIL.

``tests.userproject`` adds the test suite's defaults (its MNIST directory, this checkout on
``PYTHONPATH``) and its other user modules.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np

MNIST_TRAIN_SPLIT = 8000
"""The split the PNG files are written for (``--train-split``, as ``tests.procs.MNIST_ARGS``):
images below it train, the rest are held out."""


def mnist_images(data_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """The images of the MNIST split in ``data_dir`` as uint8 ``[n, 28, 28]`` and their labels
    (``psserver.data.idx.load_mnist``'s normalisation undone, exactly: pixels are k / 255)."""
    from psserver.data.idx import MNIST_MEAN, MNIST_STD, load_mnist

    train, held_out = load_mnist(data_dir, train_split=MNIST_TRAIN_SPLIT)
    x = np.concatenate([train.tensors[0].numpy(), held_out.tensors[0].numpy()])[:, 0]
    y = np.concatenate([train.tensors[1].numpy(), held_out.tensors[1].numpy()])
    pixels = np.rint((x * MNIST_STD + MNIST_MEAN) * 255.0).clip(0, 255).astype(np.uint8)
    return pixels, y


def write_mnist_pngs(root: Path, n_train: int, n_val: int, data_dir: Path) -> Path:
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
