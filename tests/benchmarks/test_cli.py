"""The one command line of the benchmarks (``python -m benchmarks STUDY``) and the results
tables it makes from the committed JSON."""

from __future__ import annotations

import importlib
import json
import shutil

import pytest

from benchmarks import __main__ as cli
from benchmarks import tables
from benchmarks.harness import measure
from benchmarks.harness.report import paired_markdown, write_result


def test_every_study_named_has_a_main():
    for name, (module, _) in cli.STUDIES.items():
        assert callable(importlib.import_module(module).main), name


def test_an_unknown_study_is_one_line_and_exit_2(capsys):
    assert cli.main(["throughputs"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("python -m benchmarks: unknown study 'throughputs'; choose from throughput, paired")
    assert cli.main([]) == 2 and "data_loading" in capsys.readouterr().out


def test_the_committed_tables_are_what_their_json_says():
    """Every table of benchmarks/results is its JSON rendered by the study that wrote it."""
    changed, _ = tables.tables(measure.RESULTS, check=True)
    assert not changed, f"run python -m benchmarks tables: {[str(p) for p in changed]}"


def test_a_table_edited_by_hand_is_found_and_made_again(tmp_path, capsys):
    src = measure.RESULTS / "memory-state" / "paired-mnist_cnn-b64.json"
    shutil.copy(src, tmp_path / src.name)
    shutil.copy(src.with_suffix(".md"), tmp_path / src.with_suffix(".md").name)
    md = tmp_path / "paired-mnist_cnn-b64.md"
    md.write_text(md.read_text().replace("| local-1t |", "| local-1t (edited) |", 1))
    assert tables.main(["--results-dir", str(tmp_path), "--check"]) == 1
    assert tables.main(["--results-dir", str(tmp_path)]) == 0
    assert md.read_text() == paired_markdown(json.loads(src.read_text()))
    assert tables.main(["--results-dir", str(tmp_path), "--check"]) == 0


def test_the_writer_names_the_study_and_renders_the_json(tmp_path):
    seen = []
    md = write_result(tmp_path / "r-0.5mbit", {"value": 1.5}, "paired", lambda r: seen.append(r) or "table\n")
    assert json.loads((tmp_path / "r-0.5mbit.json").read_text()) == {"study": "paired", "value": 1.5}
    assert md == (tmp_path / "r-0.5mbit.md").read_text() == "table\n" and seen == [{"study": "paired", "value": 1.5}]


def test_a_missing_results_dir_is_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        tables.main(["--results-dir", str(tmp_path / "nowhere")])
    assert e.value.code == 2 and "no directory" in capsys.readouterr().err
