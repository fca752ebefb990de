"""Import cycles of a package, as grimp reads its imports (lazy imports inside functions
included): ``tests/test_layers.py`` holds psserver to none, ``tests/benchmarks`` the harness."""

from __future__ import annotations


def import_cycles(package: str) -> list[str]:
    """Every cycle through two modules of ``package`` that import each other directly or
    through a chain, as ``a -> b -> ... -> a`` (the shortest chain back), sorted; [] when none."""
    import grimp

    graph = grimp.build_graph(package, cache_dir=None)
    cycles = set()
    for importer in graph.modules:
        for imported in graph.find_modules_directly_imported_by(importer):
            back = graph.find_shortest_chain(importer=imported, imported=importer)
            if back is not None:
                cycles.add(" -> ".join((importer, *back)))
    return sorted(cycles)
