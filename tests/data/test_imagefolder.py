"""``--dataset imagefolder``: PNG files the test writes from the real MNIST split, and every
bad layout in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from psserver.config import DataConfig
from psserver.data import Batches, load_dataset
from psserver.data.imagefolder import load_imagefolder
from psserver.errors import DataError
from tests.procs import MNIST_DIR
from tests.userproject import MNIST_TRAIN_SPLIT, mnist_images, write_mnist_pngs


@pytest.fixture(scope="module")
def pngs(tmp_path_factory) -> Path:
    if not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"real MNIST split not found at {MNIST_DIR}")
    return write_mnist_pngs(tmp_path_factory.mktemp("pngs"), 120, 40)


def test_mnist_pngs_read_back_as_one_channel_28x28(pngs, mnist_dir):
    train, val = load_dataset(DataConfig(dataset="imagefolder", data_dir=pngs), (1, 28, 28), 10)
    assert (len(train), len(val)) == (120, 40)
    assert train.classes == [str(i) for i in range(10)]
    pixels, labels = mnist_images(mnist_dir)
    # Each file is its MNIST image: ToTensor then Normalize(0.5, 0.5), in its label's folder.
    path, label = train.samples[0]
    i = int(Path(path).stem)
    x, y = train[0]
    assert x.shape == (1, 28, 28) and x.dtype == torch.float32 and y == label == int(labels[i])
    assert torch.allclose(x[0], torch.from_numpy(pixels[i] / 255.0).float() * 2 - 1, atol=1e-6)
    assert all(int(Path(p).stem) >= MNIST_TRAIN_SPLIT for p, _ in val.samples)
    # Batches through the DataLoader with workers.
    batches = Batches(train, name="imagefolder", batch_size=32, workers=1)
    xb, yb = next(iter(batches.epoch(0)))
    batches.close()
    assert xb.shape == (32, 1, 28, 28) and yb.dtype == torch.int64


def test_val_uses_the_training_classes(tmp_path, pngs):
    import shutil

    shutil.copytree(pngs, tmp_path / "d")
    shutil.rmtree(tmp_path / "d" / "val" / "0")  # a class with no held-out images: its numbering stays
    _, val = load_imagefolder(tmp_path / "d")
    assert all(target == int(Path(path).parent.name) for path, target in val.samples)
    (tmp_path / "d" / "val" / "cat").mkdir()
    with pytest.raises(DataError, match=r"val has class folder\(s\) cat that .*train does not have"):
        load_imagefolder(tmp_path / "d")


def test_rgb_images_have_three_channels_and_image_size_resizes(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        for c in ("a", "b"):
            (tmp_path / split / c).mkdir(parents=True)
            Image.fromarray(np.full((40, 30, 3), 200, np.uint8)).save(tmp_path / split / c / "x.jpg")
    train, _ = load_imagefolder(tmp_path)
    assert train[0][0].shape == (3, 40, 30)
    train, _ = load_imagefolder(tmp_path, image_size=16)
    assert train[0][0].shape == (3, 16, 16)
    with pytest.raises(DataError, match=r"samples of shape \(3, 40, 30\), the model expects \(1, 28, 28\) "
                                        r"\(--image-size N resizes images\)"):
        load_dataset(DataConfig(dataset="imagefolder", data_dir=tmp_path), (1, 28, 28), 10)
    with pytest.raises(DataError, match="has 2 classes, the model has 1 outputs"):
        load_dataset(DataConfig(dataset="imagefolder", data_dir=tmp_path), (3, 40, 30), 1)


def test_no_val_folder_holds_nothing_out(tmp_path, pngs):
    import shutil

    shutil.copytree(pngs / "train", tmp_path / "train")
    train, val = load_imagefolder(tmp_path)
    assert len(train) == 120 and val is None


def _layout(tmp_path: Path, case: str) -> Path:
    from PIL import Image

    root = tmp_path / "d"
    if case == "missing":
        return root
    if case == "file":
        root.write_text("x")
        return root
    root.mkdir()
    if case == "no train":
        (root / "val").mkdir()
    elif case == "train is a file":
        (root / "train").write_text("x")
    elif case == "no classes":
        (root / "train").mkdir()
        Image.fromarray(np.zeros((4, 4), np.uint8)).save(root / "train" / "0.png")
    elif case == "no images":
        (root / "train" / "3").mkdir(parents=True)
        (root / "train" / "3" / "notes.txt").write_text("x")
    elif case == "directory as image":
        (root / "train" / "3" / "0.png").mkdir(parents=True)
    elif case == "not an image":
        (root / "train" / "3").mkdir(parents=True)
        (root / "train" / "3" / "0.png").write_text("not a png")
    return root


@pytest.mark.parametrize(("case", "match"), [
    ("missing", r"--data-dir .*d does not exist \(--dataset imagefolder reads DIR/train/<class>/<image>"),
    ("file", r"--data-dir .*d is a file, not a directory"),
    ("no train", r"--data-dir .*d has no train/ subfolder"),
    ("train is a file", r"d/train is a file where the directory of training classes belongs"),
    ("no classes", r"d/train holds no class folders \(images go in .*/train/<class>/<image>\)"),
    ("no images", r"no images \(.png, .jpg, .jpeg, ...\) in .*d/train/3$"),
    ("directory as image", r"d/train/3/0.png is a directory where an image file belongs"),
    ("not an image", r"d/train/3/0.png is not an image PIL can read \(UnidentifiedImageError"),
])
def test_bad_layouts_are_one_line(tmp_path, case, match):
    root = _layout(tmp_path, case)
    with pytest.raises(DataError, match=match) as e:
        if case in ("no images", "directory as image", "not an image"):
            DataConfig(dataset="imagefolder", data_dir=root)  # the layout is there: found when loading
            load_imagefolder(root)
        else:
            DataConfig(dataset="imagefolder", data_dir=root)
    assert "\n" not in str(e.value)


def test_a_corrupt_image_later_on_is_one_line(tmp_path, pngs):
    import shutil

    shutil.copytree(pngs, tmp_path / "d")
    bad = sorted((tmp_path / "d" / "train" / "7").iterdir())[0]
    bad.write_bytes(b"truncated")
    train, _ = load_imagefolder(tmp_path / "d")
    batches = Batches(train, name="imagefolder", batch_size=200, shuffle=False, workers=1)
    with pytest.raises(DataError, match=r"^dataset imagefolder: reading batch 0 of epoch 0 failed: .*cannot identify "
                                        r"image file .*7/\d+.png"):
        list(batches.epoch(0))
    batches.close()
