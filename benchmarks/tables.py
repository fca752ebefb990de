"""``python -m benchmarks tables``: every Markdown table of ``benchmarks/results`` made again
from the JSON beside it, with the renderer of the study that wrote it, so a committed table
never says what its JSON does not. ``--check`` writes nothing and exits 1 where a table differs.

A result names its study (``report.write_result``); older results are known by their file name.
JSON of no study here (raw timings, older formats) has no table and is listed as such."""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from collections.abc import Callable
from pathlib import Path

from benchmarks.harness import measure
from benchmarks.harness.report import paired_markdown


def _renderers() -> dict[str, Callable[[dict], str]]:
    from benchmarks.studies import data_loading, diloco, model_join, readers, restart, servers_scaling, state_copy
    from benchmarks.studies.embedding import report as embedding
    from benchmarks.studies.throughput import report as throughput

    return {"throughput": throughput.markdown, "paired": paired_markdown, "data_loading": data_loading.markdown,
            "servers_scaling": servers_scaling.markdown, "embedding_tables": embedding.markdown,
            "restart": restart.markdown, "model_join": model_join.markdown, "state_copy": state_copy.markdown,
            "diloco": diloco.markdown, "readers": readers.markdown}


BY_NAME = (("paired-*.json", "paired"), ("bench-*.json", "throughput"), ("latest.json", "throughput"),
           ("before-compute-thread-*.json", "throughput"), ("data_loading-*.json", "data_loading"),
           ("servers-scaling-*.json", "servers_scaling"), ("embedding-tables.json", "embedding_tables"),
           ("restart-*.json", "restart"), ("state-copy-*.json", "state_copy"), ("model-join/*.json", "model_join"))
"""Studies of results written before each result named its study."""


def study_of(path: Path, result: dict, root: Path) -> str | None:
    if isinstance(result, dict) and result.get("study"):
        return result["study"]
    rel = path.relative_to(root).as_posix()
    for pattern, study in BY_NAME:
        if fnmatch.fnmatch(path.name, pattern) or fnmatch.fnmatch(rel, f"*{pattern}"):
            return study
    return None


def tables(root: Path, check: bool) -> tuple[list[Path], list[str]]:
    """(tables that differ from their JSON, or were written; JSON files with no table and why)."""
    renderers = _renderers()
    changed, untabled = [], []
    for path in sorted(root.rglob("*.json")):
        result = json.loads(path.read_text())
        study = study_of(path, result, root)
        if study is None:
            untabled.append(f"{path.relative_to(root)}: no study renders it")
            continue
        md = renderers[study](result)
        target = path.with_suffix(".md")
        if not target.is_file() or target.read_text() != md:
            changed.append(target)
            if not check:
                target.write_text(md)
    return changed, untabled


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks tables", description=__doc__.splitlines()[0])
    p.add_argument("--results-dir", type=Path, default=measure.RESULTS, help="the results tree (default: the repo's)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a table differs from its JSON")
    args = p.parse_args(argv)
    if not args.results_dir.is_dir():
        p.error(f"--results-dir: no directory {args.results_dir}")
    changed, untabled = tables(args.results_dir, args.check)
    for line in untabled:
        sys.stdout.write(f"no table: {line}\n")
    for path in changed:
        sys.stdout.write(f"{'differs' if args.check else 'wrote'}: {path}\n")
    return 1 if args.check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
