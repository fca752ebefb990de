"""The suite's file order (``tests.durations``): the longest files first, whole, each in its own order."""

from __future__ import annotations

from types import SimpleNamespace

from tests import durations


def test_files_run_longest_first_whole_and_in_their_own_order(monkeypatch):
    monkeypatch.setattr(durations, "load", lambda: {"a.py": 5, "b.py": 90, "c.py": 30})
    ids = ["a.py::1", "a.py::2", "b.py::1", "c.py::1", "new.py::1", "b.py::2", "c.py::2"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    durations.longest_files_first(items)  # type: ignore[arg-type]
    assert [i.nodeid for i in items] == ["b.py::1", "b.py::2", "new.py::1", "c.py::1", "c.py::2", "a.py::1",
                                         "a.py::2"]

