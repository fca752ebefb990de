"""``--dataset imagefolder --data-dir DIR``: images on disk, one folder per class, no user code.

``DIR/train/<class>/<image>`` trains and ``DIR/val/<class>/<image>`` is held out (torchvision's
``ImageFolder`` layout; images in subfolders of a class folder count too; no ``val/``: nothing
is held out). Classes are the folder names of ``train/`` in sorted order, and ``val/`` uses the
same numbering (a class missing from ``val/`` is fine, one that ``train/`` lacks is an error).

Transforms, the same for both splits: every image is read in the mode of the first training
image, grayscale (``1``, ``L``, ``LA``: one channel) or else RGB (three), so a folder of
grayscale PNGs keeps MNIST's ``1 x H x W``; with ``--image-size N`` it is resized (shorter side)
and center-cropped to ``N x N``; ``ToTensor`` (values in [0, 1]) and ``Normalize(0.5, 0.5)``
per channel (values in [-1, 1]: centred, as training with stale gradients wants). No random
augmentation: held-out numbers stay comparable between runs.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

from torch.utils.data import Dataset
from torchvision.datasets import ImageFolder

from psserver.errors import DataError

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
"""Files that count as images (case-insensitive), torchvision's list."""
GRAYSCALE_MODES = frozenset({"1", "L", "LA"})
"""PIL modes read as one channel; any other is read as RGB."""
LAYOUT = "DIR/train/<class>/<image> and DIR/val/<class>/<image>"


@dataclasses.dataclass(frozen=True)
class ImageLoader:
    """Reads one image in ``mode`` (picklable: DataLoader workers get a copy)."""

    mode: str

    def __call__(self, path: str):
        from PIL import Image

        with open(path, "rb") as f:
            image = Image.open(f)
            return image.convert(self.mode)


def check_layout(data_dir: Path) -> Path:
    """``DIR/train`` after checking the layout is there (a directory of class folders):
    ``DataError`` of one line otherwise. Cheap: the images are scanned when loading."""
    data_dir = Path(data_dir)
    if not data_dir.exists():
        raise DataError(f"--data-dir {data_dir} does not exist (--dataset imagefolder reads {LAYOUT})")
    if not data_dir.is_dir():
        raise DataError(f"--data-dir {data_dir} is a file, not a directory (--dataset imagefolder reads {LAYOUT})")
    train = data_dir / "train"
    if not train.exists():
        raise DataError(f"--data-dir {data_dir} has no train/ subfolder (--dataset imagefolder reads {LAYOUT})")
    if not train.is_dir():
        raise DataError(f"{train} is a file where the directory of training classes belongs ({LAYOUT})")
    if not _class_folders(train):
        raise DataError(f"{train} holds no class folders (images go in {train}/<class>/<image>)")
    return train


def load_imagefolder(data_dir: Path, image_size: int | None = None) -> tuple[Dataset, Dataset | None]:
    """The ``train/`` and ``val/`` splits of ``data_dir`` (``val``: None when absent)."""
    from torchvision import transforms

    train_dir = check_layout(data_dir)
    classes = _class_folders(train_dir)
    train = ImageFolderSplit(train_dir, classes)
    mode = _mode_of(train.samples[0][0])
    steps = [transforms.Resize(image_size), transforms.CenterCrop(image_size)] if image_size else []
    channels = 1 if mode == "L" else 3
    transform = transforms.Compose([*steps, transforms.ToTensor(),
                                    transforms.Normalize([0.5] * channels, [0.5] * channels)])
    train.loader, train.transform = ImageLoader(mode), transform
    val_dir = Path(data_dir) / "val"
    held_out = None
    if not val_dir.exists():
        log.warning("%s has no val/ subfolder: nothing is held out, evaluation is skipped", data_dir)
    elif not val_dir.is_dir():
        raise DataError(f"{val_dir} is a file where the directory of held-out classes belongs ({LAYOUT})")
    else:
        extra = sorted(set(_class_folders(val_dir)) - set(classes))
        if extra:
            raise DataError(f"{val_dir} has class folder(s) {', '.join(extra)} that {train_dir} does not have")
        held_out = ImageFolderSplit(val_dir, classes, allow_empty=True)
        held_out.loader, held_out.transform = ImageLoader(mode), transform
    log.info("imagefolder %s: %d classes, %d training and %d held-out %s images%s", data_dir, len(classes),
             len(train), len(held_out) if held_out is not None else 0, "grayscale" if mode == "L" else "RGB",
             f", {image_size}x{image_size}" if image_size else "")
    return train, held_out


class ImageFolderSplit(ImageFolder):
    """torchvision's ``ImageFolder`` with the classes of the training split (so ``val/`` numbers
    them alike) and a scan that reports a bad layout in one line."""

    def __init__(self, root: Path, classes: list[str], allow_empty: bool = False) -> None:
        self._classes = list(classes)
        super().__init__(str(root), loader=ImageLoader("RGB"), allow_empty=allow_empty)

    def find_classes(self, directory: str) -> tuple[list[str], dict[str, int]]:  # noqa: ARG002 - fixed
        return self._classes, {c: i for i, c in enumerate(self._classes)}

    @staticmethod
    def make_dataset(directory: str, class_to_idx: dict[str, int], extensions=None,  # noqa: ARG004
                     is_valid_file=None, allow_empty: bool = False) -> list[tuple[str, int]]:  # noqa: ARG004
        return _scan(Path(directory), class_to_idx, allow_empty)


def _class_folders(directory: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(directory) if e.is_dir() and not e.name.startswith("."))


def _scan(directory: Path, class_to_idx: dict[str, int], allow_empty: bool = False) -> list[tuple[str, int]]:
    """(path, class) of every image under ``directory/<class>``, in sorted order."""
    samples: list[tuple[str, int]] = []
    for name in sorted(class_to_idx):
        folder = directory / name
        if not folder.is_dir():
            continue
        found = 0
        for root, dirs, files in sorted(os.walk(folder, followlinks=True)):
            for d in dirs:
                if d.lower().endswith(IMAGE_EXTENSIONS):
                    raise DataError(f"{Path(root) / d} is a directory where an image file belongs")
            for f in sorted(files):
                if f.lower().endswith(IMAGE_EXTENSIONS):
                    samples.append((os.path.join(root, f), class_to_idx[name]))
                    found += 1
        if not found and not allow_empty:
            raise DataError(f"no images ({', '.join(IMAGE_EXTENSIONS[:3])}, ...) in {folder}")
    if not samples:
        raise DataError(f"no images ({', '.join(IMAGE_EXTENSIONS[:3])}, ...) in {directory}")
    return samples


def _mode_of(path: str) -> str:
    """``L`` or ``RGB``: how the folder's images are read, decided by its first image."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return "L" if image.mode in GRAYSCALE_MODES else "RGB"
    except (OSError, UnidentifiedImageError) as e:
        raise DataError(f"{path} is not an image PIL can read ({type(e).__name__}: {e})") from None


__all__ = ["IMAGE_EXTENSIONS", "ImageFolderSplit", "check_layout", "load_imagefolder"]
