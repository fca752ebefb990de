"""``benchmarks.omp_teams``: the three thread modes run in fresh processes and are tabled."""

from __future__ import annotations

import pytest

from benchmarks import omp_teams


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_modes_are_measured_and_tabled(capsys):
    assert omp_teams.main(["--rounds", "1", "--steps", "15", "--model", "mlp", "--batch-size", "32"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]  # past the header
    assert [r.split(" | ")[0] for r in rows] == ["| main", "| one-thread", "| second-thread-first"]
    for row in rows:
        cells = row.strip("| ").split(" | ")
        assert float(cells[1]) > 0 and 0 < float(cells[3]) <= 64
    assert rows[0].split(" | ")[2] == "1.000"


def test_bad_flags_exit_2():
    with pytest.raises(SystemExit) as e:
        omp_teams.main(["--rounds", "0"])
    assert e.value.code == 2
