"""User code psserver runs (an import, a constructor, a first loss call) is bounded: an
``os._exit`` in it is one line, and a hang in it is named and stopped, while code that computes
is left alone however long it takes."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch.utils.data import Dataset

from psserver.data import check_samples
from psserver.errors import DataError, UserCodeError
from psserver.utils import user_code
from psserver.utils.references import call_user
from psserver.utils.user_code import ExitCalled, FirstCallBounded, bound_first_call, running_user_code, timeout_s
from tests.procs import run
from tests.userproject import pythonpath, write_package


def exits_recorded(code: int) -> None:
    raise AssertionError(f"os._exit({code}) reached the process")


@pytest.fixture(autouse=True)
def no_exit(monkeypatch):
    """An ``os._exit`` that escaped fails the test instead of ending the test process."""
    monkeypatch.setattr(os, "_exit", exits_recorded)


@pytest.fixture
def stopped(monkeypatch):
    """What the watchdog says instead of ending this process; ``release`` unblocks the code."""
    said: list[str] = []
    release = threading.Event()

    def stop(message: str) -> None:
        said.append(message)
        release.set()

    monkeypatch.setattr(user_code, "_stop_process", stop)
    monkeypatch.setenv(user_code.TIMEOUT_ENV, "0.2")
    return said, release


def test_a_hung_dataset_constructor_is_named_and_stopped(stopped):
    said, release = stopped
    call_user(lambda: release.wait(30), (), {}, "--dataset mypkg.data:Slow")
    assert said == [f"--dataset mypkg.data:Slow has been blocked for over 0.2 s: stopped (${user_code.TIMEOUT_ENV} "
                    "seconds, default 300; raise it for code that waits that long, 0 for no limit)"]


class SlowSample(Dataset):
    def __init__(self, release: threading.Event) -> None:
        self.release = release

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        if not self.release.wait(30):
            os._exit(0)  # never released: stands for any exit
        return torch.zeros(2), 0


def test_a_dataset_whose_first_sample_hangs_is_named_and_stopped(stopped):
    said, release = stopped
    check_samples(SlowSample(release), "mypkg.data:Slow")
    assert len(said) == 1 and said[0].startswith("dataset mypkg.data:Slow: reading sample 0 has been blocked for "
                                                 "over 0.2 s: stopped")


def test_a_dataset_whose_first_sample_exits_is_one_line(monkeypatch):
    monkeypatch.setenv(user_code.TIMEOUT_ENV, "0")
    release = threading.Event()
    release.wait = lambda timeout: False  # type: ignore[method-assign]
    with pytest.raises(DataError, match=r"^dataset d: reading sample 0 failed: called os._exit\(0\)$"):
        check_samples(SlowSample(release), "d")


def test_code_that_computes_is_not_stopped():
    said: list[str] = []
    with running_user_code("computing", 0.05, expire=said.append):
        start = time.thread_time()
        while time.thread_time() - start < 0.3:  # six limits of CPU time
            pass
    assert said == []


def test_os_exit_in_user_code_is_an_error_in_its_thread_only(monkeypatch):
    monkeypatch.setenv(user_code.TIMEOUT_ENV, "0")
    with pytest.raises(UserCodeError, match=r"^--model m raised called os._exit\(3\)"):
        call_user(lambda: os._exit(3), (), {}, "--model m")
    assert os._exit is exits_recorded  # put back
    calls = []
    monkeypatch.setattr(os, "_exit", calls.append)
    with running_user_code("elsewhere", None):
        other = threading.Thread(target=lambda: os._exit(5))  # psserver's own thread: exits as asked
        other.start()
        other.join()
        with pytest.raises(ExitCalled):
            os._exit(4)
    assert calls == [5] and os._exit == calls.append


def test_a_first_loss_call_that_exits_is_one_line(monkeypatch):
    monkeypatch.setenv(user_code.TIMEOUT_ENV, "0")
    loss = FirstCallBounded(lambda out, target: os._exit(0), "--loss mypkg.losses:bad")
    with pytest.raises(UserCodeError, match=r"^--loss mypkg.losses:bad called os._exit\(0\) in its first call$"):
        loss(1, 2)
    twice = FirstCallBounded(lambda a, b: a + b, "--loss x:y")
    assert twice(1, 2) == 3 and twice(2, 2) == 4


def test_a_loss_module_stays_itself_and_its_first_call_is_bounded(monkeypatch):
    monkeypatch.setenv(user_code.TIMEOUT_ENV, "0")
    calls = []

    class Exits(torch.nn.Module):
        def forward(self, out, target):
            calls.append(out)
            if len(calls) == 1:
                os._exit(0)
            return out

    loss = Exits()
    assert bound_first_call(bound_first_call(loss, "--loss a:Exits"), "--loss a:Exits") is loss
    with pytest.raises(UserCodeError, match=r"^--loss a:Exits called os._exit\(0\) in its first call$"):
        loss(1, 2)
    assert loss(3, 4) == 3 and "forward" not in vars(loss)


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf"])
def test_a_bad_timeout_is_one_line(monkeypatch, value):
    monkeypatch.setenv(user_code.TIMEOUT_ENV, value)
    with pytest.raises(UserCodeError, match=rf"^\${user_code.TIMEOUT_ENV}='{value}' is not a number of seconds"):
        timeout_s()
    monkeypatch.setenv(user_code.TIMEOUT_ENV, "0")
    assert timeout_s() is None
    monkeypatch.delenv(user_code.TIMEOUT_ENV)
    assert timeout_s() == user_code.DEFAULT_TIMEOUT_S


def test_an_import_that_hangs_ends_the_process_in_one_line(tmp_path):
    """End to end: the watchdog's exit, which no in-process test can take."""
    write_package(tmp_path, "hangpkg", {"models": "import threading\nthreading.Event().wait()\n"})
    done = run(["serve", "--port", "1", "--model", "hangpkg.models:Net"], timeout=60,
               env={"PYTHONPATH": pythonpath(tmp_path), user_code.TIMEOUT_ENV: "0.3"})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].endswith(
        "--model hangpkg.models:Net: importing module 'hangpkg.models' has been blocked for over 0.3 s: stopped "
        f"(${user_code.TIMEOUT_ENV} seconds, default 300; raise it for code that waits that long, 0 for no limit)")
