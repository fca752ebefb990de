"""The readers-writer lock that keeps ``alone`` tests alone under pytest-xdist, and the order
in which the files go to the workers."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest

from tests.workers import UNMEASURED_S, MachineShare, longest_files_first, read_file_seconds, seconds_per_file


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

    threading.Thread(target=next_test, daemon=True).start()
    assert entered.wait(5)
    assert not first_done.wait(0.3), "an ordinary test ran beside an alone one"
    leave.set()
    t.join(5)
    assert first_done.wait(5)


def test_files_go_longest_first_and_keep_their_tests_in_order():
    items = [SimpleNamespace(nodeid=n) for n in (
        "tests/a.py::t1", "tests/a.py::t2", "tests/b.py::t1", "tests/new.py::t1", "tests/c.py::t1", "tests/c.py::t2")]
    seconds = {"tests/a.py": 5.0, "tests/b.py": 300.0, "tests/c.py": 5.0}
    ordered = [i.nodeid for i in longest_files_first(items, seconds)]
    assert ordered == ["tests/b.py::t1", "tests/new.py::t1",  # unmeasured: UNMEASURED_S
                       "tests/a.py::t1", "tests/a.py::t2", "tests/c.py::t1", "tests/c.py::t2"]
    assert 5.0 < UNMEASURED_S < 300.0


def test_the_seconds_per_file_come_from_a_junit_report(tmp_path):
    (tmp_path / "run.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_workers" name="a" time="1.25"/>'
        '<testcase classname="tests.test_workers" name="b" time="2.5"/>'
        '<testcase classname="tests.ps.test_end_to_end" name="c" time="40"/>'
        "</testsuite></testsuites>")
    assert seconds_per_file(tmp_path / "run.xml") == {"tests/ps/test_end_to_end.py": 40.0,
                                                      "tests/test_workers.py": 3.8}


def test_a_missing_or_malformed_table_leaves_the_collection_order(tmp_path):
    assert read_file_seconds(tmp_path / "absent.json") == {}
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert read_file_seconds(tmp_path / "bad.json") == {}
    (tmp_path / "ok.json").write_text(json.dumps({"tests/a.py": 3}))
    assert read_file_seconds(tmp_path / "ok.json") == {"tests/a.py": 3.0}
