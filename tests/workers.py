"""Two tests at a time (pytest-xdist), and the tests that need the machine to themselves.

Most of the suite's time is real processes waiting: for a heartbeat to be missed, a server to
come back, a rate-limited link. Two xdist workers (``-n auto``, at most 2: the suite is sized for
the 2-core CI machine) fill those waits with another test. A test whose assertion is a time or a
rate measured on this machine (a restart pause, a bandwidth ratio, an alert's firing window)
carries ``@pytest.mark.alone``: it waits until the other worker is between tests and keeps it
there until it is done.

That is a readers-writer lock over the run, on files (``fcntl.flock``): a test takes the shared
side, an ``alone`` test the exclusive one. A turnstile taken first, and held by an ``alone`` test
while it waits, keeps the other worker from starving it by taking the shared side again and again.

The files go to the workers longest first (``FILE_SECONDS``, measured in a full run), so that the
run does not end on one worker still busy with a long file while the other has none left. To
measure them again: ``python -m pytest --junitxml=run.xml`` on the CI machine, then
``python -m tests.workers run.xml``.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

LOCKS_ENV = "PSSERVER_TEST_LOCKS"
"""The directory of this run's lock files, made by the controller and inherited by its workers."""
MAX_WORKERS = 2
ROOT = Path(__file__).resolve().parents[1]
FILE_SECONDS = ROOT / "tests" / "file_seconds.json"
"""Each test file's seconds in a full run, two at a time on the 2-core CI machine."""
UNMEASURED_S = 30.0
"""What a file that is not in ``FILE_SECONDS`` (a new one) is taken to need."""


def auto_workers() -> int:
    """Workers for ``-n auto``: one per CPU, at most ``MAX_WORKERS``."""
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


class MachineShare:
    """This worker's side of the run's readers-writer lock (one per worker process)."""

    def __init__(self, directory: Path) -> None:
        self._turnstile = open(directory / "turnstile", "a")  # held for the worker's life
        self._share = open(directory / "share", "a")

    @contextmanager
    def held(self, alone: bool) -> Iterator[None]:
        fcntl.flock(self._turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(self._share, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        except BaseException:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
            raise
        if not alone:
            fcntl.flock(self._turnstile, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(self._share, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(self._turnstile, fcntl.LOCK_UN)

    def close(self) -> None:
        self._turnstile.close()
        self._share.close()


def longest_files_first(items: list, seconds: dict[str, float]) -> list:
    """``items`` (pytest's) with their files in decreasing order of ``seconds``; the order within
    a file, and between files of the same time, is kept."""
    order: dict[str, int] = {}
    for item in items:
        order.setdefault(item.nodeid.split("::")[0], len(order))
    return sorted(items, key=lambda item: (-seconds.get(path := item.nodeid.split("::")[0], UNMEASURED_S),
                                           order[path]))


def read_file_seconds(path: Path = FILE_SECONDS) -> dict[str, float]:
    try:
        return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}  # no table: collection order


def seconds_per_file(junit_xml: Path) -> dict[str, float]:
    """Seconds per test file in a JUnit report of pytest's (setup, call and teardown)."""
    per: Counter[str] = Counter()
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        per[_file_of(case.get("classname", ""))] += float(case.get("time") or 0)
    return {path: round(t, 1) for path, t in per.most_common()}


def _file_of(classname: str) -> str:
    """``tests.ps.test_x`` or ``tests.ps.test_x.TestY``: ``tests/ps/test_x.py``."""
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        path = "/".join(parts[:n]) + ".py"
        if (ROOT / path).is_file():
            return path
    return "/".join(parts) + ".py"


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m tests.workers JUNIT_XML  (writes tests/file_seconds.json)", file=sys.stderr)
        return 2
    FILE_SECONDS.write_text(json.dumps(seconds_per_file(Path(argv[0])), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
