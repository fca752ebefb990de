"""The readers-writer lock that keeps ``alone`` tests alone under pytest-xdist."""

from __future__ import annotations

import threading
import time

import pytest

from tests.workers import MachineShare


@pytest.fixture
def shares(tmp_path):
    made = [MachineShare(tmp_path) for _ in range(2)]
    yield made
    for s in made:
        s.close()


def _in_thread(share: MachineShare, alone: bool, entered: threading.Event, leave: threading.Event) -> threading.Thread:
    def run() -> None:
        with share.held(alone):
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.timeout(30)
def test_two_tests_share_and_an_alone_test_waits_for_the_other(shares):
    a, b = shares
    with a.held(alone=False):
        entered, leave = threading.Event(), threading.Event()
        t = _in_thread(b, False, entered, leave)
        assert entered.wait(5), "two ordinary tests run at once"
        leave.set()
        t.join(5)
        entered, leave = threading.Event(), threading.Event()
        t = _in_thread(b, True, entered, leave)
        assert not entered.wait(0.3), "an alone test started beside another"
    assert entered.wait(5)
    leave.set()
    t.join(5)


@pytest.mark.timeout(30)
def test_an_alone_test_that_waits_holds_off_the_next_ordinary_one(shares):
    a, b = shares
    first_done, entered, leave = threading.Event(), threading.Event(), threading.Event()
    with a.held(alone=False):
        t = _in_thread(b, True, entered, leave)  # waits for the test in progress
        time.sleep(0.2)
    # The worker's next ordinary test must not slip in ahead of the waiting alone test.
    def next_test() -> None:
        with a.held(alone=False):
            first_done.set()

    after = threading.Thread(target=next_test, daemon=True)
    after.start()
    assert entered.wait(5)
    assert not first_done.wait(0.3), "an ordinary test ran beside an alone one"
    leave.set()
    t.join(5)
    assert first_done.wait(5)
    after.join(5)  # its unlock before the fixture closes the files
