"""The order files run in: the longest first, so that two workers end together.

pytest-xdist hands whole files to its workers (``--dist loadfile``), by default the files of
most tests first, which put the few long end-to-end files last: one worker then ran a
two-minute file while the other sat idle. Longest first (a list scheduler's LPT rule) leaves
only short files for the end. ``tests/durations.json`` holds each file's seconds from a
profiled run on the 2-core CI machine; a file it does not know counts as a minute (new files
are usually end-to-end). Regenerate it from a run's JUnit XML::

    python3 -m pytest --junitxml=/tmp/suite.xml && python3 -m tests.durations /tmp/suite.xml
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

import pytest

TABLE = Path(__file__).with_name("durations.json")
UNKNOWN_S = 60


def load() -> dict[str, float]:
    try:
        return json.loads(TABLE.read_text())
    except (OSError, ValueError):
        return {}


def longest_files_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: whole files, the longest first, each file's own order kept."""
    seconds = load()
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::", 1)[0], i)

    def key(item: pytest.Item) -> tuple[float, int]:
        path = item.nodeid.split("::", 1)[0]
        return -seconds.get(path, UNKNOWN_S), first_seen[path]

    items.sort(key=key)  # stable: a file's tests keep their order


def from_junit(path: Path) -> dict[str, int]:
    """Seconds per test file in a JUnit XML report (pytest's ``--junitxml``)."""
    totals: Counter[str] = Counter()
    for case in ET.parse(path).iter("testcase"):
        totals[case.get("classname", "").replace(".", "/") + ".py"] += float(case.get("time", 0))
    return {name: round(s) for name, s in sorted(totals.items()) if s >= 1 and Path(name).is_file()}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python3 -m tests.durations JUNIT.xml")
    TABLE.write_text(json.dumps(from_junit(Path(sys.argv[1])), indent=1, sort_keys=True) + "\n")
