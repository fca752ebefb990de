"""``--dataset pysource``: next-byte prediction on the Python standard library's own sources.

A text corpus every machine with Python has, needing no download: the ``.py`` files of the
running interpreter's standard library (not its tests, not ``site-packages``: about 650 files,
11 MB for CPython 3.11). Files are taken in the order of their paths, every tenth one held out,
so the held-out bytes come from modules the model never trained on. Each split is its files'
bytes end to end; a sample is ``seq_len`` bytes and its target the same bytes shifted by one.
"""

from __future__ import annotations

import logging
import os
import sysconfig
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

from psserver.errors import DataError

log = logging.getLogger(__name__)

HELD_OUT_EVERY = 10
"""Every tenth file (in the order of their paths) is held out."""
SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo"})


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """The standard library's ``.py`` files under ``root`` (the running interpreter's), in the
    order of their relative paths."""
    root = Path(sysconfig.get_paths()["stdlib"] if root is None else root)
    found = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]  # site-packages is most of the tree: never walked
        found += [Path(here, f) for f in files if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _stream(files: list[Path], limit: int) -> torch.Tensor:
    """Up to ``limit`` bytes of ``files``, end to end (uint8)."""
    chunks, total = [], 0
    for path in files:
        if total >= limit:
            break
        try:
            data = path.read_bytes()
        except OSError:  # a file that went away or cannot be read: the corpus is what can be
            continue
        chunks.append(data[: limit - total])
        total += len(chunks[-1])
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


def _windows(stream: torch.Tensor, seq_len: int, n: int) -> TensorDataset:
    x = stream[: n * seq_len].view(n, seq_len).long()
    y = stream[1 : n * seq_len + 1].view(n, seq_len).long()
    return TensorDataset(x, y)


def load_pysource(seq_len: int, n_train: int, n_eval: int, root: Path | None = None) -> tuple[TensorDataset,
                                                                                            TensorDataset]:
    """``n_train`` training and ``n_eval`` held-out samples of ``seq_len`` bytes (``DataError``
    when the sources hold fewer)."""
    files = stdlib_sources(root)
    held = files[::HELD_OUT_EVERY]
    train = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY]
    splits = []
    for name, chosen, n in (("training", train, n_train), ("held-out", held, n_eval)):
        stream = _stream(chosen, n * seq_len + 1)
        have = (len(stream) - 1) // seq_len
        if have < n:
            raise DataError(f"--dataset pysource: the standard library's sources hold {have} {name} samples of "
                            f"{seq_len} bytes, {n} asked (--train-samples / --eval-samples)")
        splits.append(_windows(stream, seq_len, n))
    log.info("pysource: %d training and %d held-out samples of %d bytes from %d files of %s", n_train, n_eval,
             seq_len, len(files), sysconfig.get_paths()["stdlib"] if root is None else root)
    return splits[0], splits[1]
