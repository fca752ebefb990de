"""Shared fixtures: free ports, real server/trainer processes that are always cleaned up."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import pytest

from tests.procs import MNIST_DIR, free_port  # noqa: F401  (re-exported for tests)


@pytest.fixture
def port() -> int:
    return free_port()


@pytest.fixture
def mnist_dir():
    if not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"real MNIST split not found at {MNIST_DIR}")
    return MNIST_DIR


@pytest.fixture(scope="session")
def mnist_pngs(tmp_path_factory):
    """8000 training and 2000 held-out MNIST images as PNG files in the imagefolder layout
    (``tests.userproject.write_mnist_pngs``), written once for the whole run."""
    if not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").is_file():
        pytest.skip(f"real MNIST split not found at {MNIST_DIR}")
    from tests.userproject import write_mnist_pngs

    return write_mnist_pngs(tmp_path_factory.mktemp("mnist-pngs"), 8000, 2000)


@pytest.fixture
def state_dir():
    """A directory for the server's state in memory, on the memory filesystem where it lives in
    production (``/dev/shm``), removed after the test."""
    import shutil
    import uuid

    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    path = root / f"psserver-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def procs():
    """Processes started through this fixture are killed (whole group) after the test."""
    from tests.procs import ProcessGroup

    group = ProcessGroup()
    try:
        yield group
    finally:
        group.kill_all()


@pytest.fixture(autouse=True)
def _restore_logging():
    """``psserver.cli.main`` configures the root logger; in-process calls must not leak it."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
