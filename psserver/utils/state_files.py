"""A model's tensors written to a file another program loads without psserver:
``.safetensors`` or ``.pt`` (``psserver export``, ``psserver pull``), never half written."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from psserver.errors import UsageError

FORMATS = {".safetensors": "safetensors", ".pt": "torch"}


def out_format(out: Path) -> str:
    """The format ``--out`` names by its suffix; ``UsageError`` for one that cannot be written."""
    fmt = FORMATS.get(out.suffix)
    if fmt is None:
        raise UsageError(f"--out {out}: name a .safetensors or a .pt file")
    if out.is_dir():
        raise UsageError(f"--out {out} is a directory: name the file to write")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: directory {out.parent} does not exist")
    return fmt


def write_state(path: Path, fmt: str, tensors: dict[str, torch.Tensor]) -> None:
    # Own, contiguous copies: safetensors refuses tensors that share memory (tied weights).
    plain = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    if fmt == "safetensors":
        from safetensors.torch import save

        write_atomic(path, lambda f: f.write(save(plain)))
    else:
        write_atomic(path, lambda f: torch.save(plain, f))


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write through a temporary file in the same directory, then rename: never half a file."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
