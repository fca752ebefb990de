"""GPU tests: each is skipped without the GPUs it needs and carries the ``gpu`` mark, so that
``pytest -m gpu`` (``benchmarks/gpu_paths.sh tests``) collects every one of them; the test
session refuses one that has the skip without the mark (``tests/conftest.py``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

F = TypeVar("F", bound=Callable)

_NEEDS = re.compile(r"^needs .*\b(CUDA|GPUs?)\b")
"""How the reason of a skip for want of a GPU reads."""


def cuda_marks(devices: int = 1) -> list[pytest.MarkDecorator]:
    """The marks of a test (or a ``pytest.param``) that needs ``devices`` CUDA devices: ``gpu``,
    and a skip without them."""
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    reason = "needs a CUDA GPU (none visible)" if devices == 1 else f"needs {devices} CUDA GPUs ({have} visible)"
    return [pytest.mark.gpu, pytest.mark.skipif(have < devices, reason=reason)]


def needs_cuda(devices: int = 1) -> Callable[[F], F]:
    """Decorate a test with :func:`cuda_marks`."""
    def mark(test: F) -> F:
        for m in cuda_marks(devices):
            test = m(test)
        return test

    return mark


def needs_gpu(item: pytest.Item) -> bool:
    """Whether ``item`` is skipped for want of a GPU (a ``skipif`` whose reason says it needs one)."""
    return any(_NEEDS.search(str(m.kwargs.get("reason", ""))) for m in item.iter_markers("skipif"))
