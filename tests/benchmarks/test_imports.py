"""The harness's modules import one way: no module of ``benchmarks`` imports, through any
chain, a module that imports it (``tests/test_layers.py`` holds psserver to the same), and
none imports the test suite."""

from __future__ import annotations

import pytest

from tests.imports import import_cycles


@pytest.mark.timeout(120)
def test_no_import_cycles():
    cycles = import_cycles("benchmarks")
    assert not cycles, "\n".join(cycles)


@pytest.mark.timeout(120)
def test_the_harness_imports_nothing_of_the_tests():
    import grimp

    graph = grimp.build_graph("benchmarks", include_external_packages=True, cache_dir=None)
    importers = graph.find_modules_that_directly_import("tests") if "tests" in graph.modules else set()
    assert not importers, sorted(importers)


@pytest.mark.timeout(120)
def test_a_cycle_is_found(tmp_path, monkeypatch):
    """The check sees a cycle made only of an import inside a function."""
    pkg = tmp_path / "cyclic"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyclic import b\n")
    (pkg / "b.py").write_text("def f():\n    from cyclic import a\n")
    (pkg / "c.py").write_text("from cyclic import b\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("cyclic") == ["cyclic.a -> cyclic.b -> cyclic.a", "cyclic.b -> cyclic.a -> cyclic.b"]


@pytest.mark.timeout(120)
def test_the_harness_imports_no_study():
    """Studies are built on the harness, never the reverse: a study can move or go without
    touching what the others stand on."""
    import grimp

    graph = grimp.build_graph("benchmarks", cache_dir=None)
    harness = {m for m in graph.modules if m.startswith("benchmarks.harness")}
    studies = {m for m in graph.modules if m.startswith("benchmarks.studies")}
    assert harness and studies
    chains = [(h, s) for h in sorted(harness) for s in sorted(studies)
              if graph.find_shortest_chain(importer=h, imported=s) is not None]
    assert not chains, chains
