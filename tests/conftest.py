"""Shared fixtures: free ports, real server/trainer processes that are always cleaned up."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from tests.durations import longest_files_first
from tests.gpu import needs_gpu
from tests.procs import MNIST_DIR, free_port  # noqa: F401  (re-exported for tests)
from tests.workers import LOCKS_ENV, MachineShare, auto_workers

_SHARE = pytest.StashKey[MachineShare]()
_LOCKS = pytest.StashKey[Path]()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return auto_workers()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first (``tests.durations``): with ``--no-loadscope-reorder`` xdist
    hands them out in this order. A test skipped for want of a GPU without the ``gpu`` mark is
    an error: ``pytest -m gpu`` (``benchmarks/gpu_paths.sh tests``) would drop it without a word."""
    unmarked = [item.nodeid for item in items if needs_gpu(item) and item.get_closest_marker("gpu") is None]
    if unmarked:
        raise pytest.UsageError("skipped without a GPU but not marked gpu (tests.gpu.needs_cuda marks both): "
                                + ", ".join(unmarked[:5]))
    longest_files_first(items)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"{signal.Signals(signum).name} received")


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM interrupts the run as Ctrl-C does, so that pytest still tears the fixtures down:
    the servers a test started live in sessions of their own, and a run killed outright (a CI
    timeout) would leave them running. The controller of several workers makes the run's lock
    directory; each worker opens it (``tests.workers``)."""
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        try:
            signal.signal(signal.SIGTERM, _interrupt)
        except ValueError:  # not the main thread: this process's owner handles its signals
            pass
    if hasattr(config, "workerinput"):
        if LOCKS_ENV in os.environ:
            config.stash[_SHARE] = MachineShare(Path(os.environ[LOCKS_ENV]))
    elif getattr(config.option, "numprocesses", None):
        config.stash[_LOCKS] = Path(tempfile.mkdtemp(prefix="psserver-tests-"))
        os.environ[LOCKS_ENV] = str(config.stash[_LOCKS])


def pytest_unconfigure(config: pytest.Config) -> None:
    if signal.getsignal(signal.SIGTERM) is _interrupt:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _SHARE in config.stash:
        config.stash[_SHARE].close()
    if _LOCKS in config.stash:
        shutil.rmtree(config.stash[_LOCKS], ignore_errors=True)
        os.environ.pop(LOCKS_ENV, None)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Outside pytest-timeout's timer: waiting for the other worker is not the test's time."""
    share = item.config.stash.get(_SHARE, None)
    if share is None:
        return (yield)
    with share.held(alone=item.get_closest_marker("alone") is not None):
        return (yield)


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
