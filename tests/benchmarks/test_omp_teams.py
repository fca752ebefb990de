"""``benchmarks.studies.omp_teams``: the three thread modes run in fresh processes and are tabled."""

from __future__ import annotations

import json
import os
import statistics
import subprocess

import pytest

from benchmarks.studies import omp_teams


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_modes_are_measured_and_tabled(capsys, monkeypatch):
    # The real children run; a spy keeps what each one was asked to do and what it measured.
    real_run = subprocess.run
    children: list[tuple[list[str], dict]] = []

    def spy(cmd, *args, **kwargs):
        done = real_run(cmd, *args, **kwargs)
        if "--child" in cmd:
            children.append((list(cmd), json.loads(done.stdout.strip().splitlines()[-1])))
        return done

    monkeypatch.setattr(subprocess, "run", spy)
    rounds = 2
    assert omp_teams.main(["--rounds", str(rounds), "--steps", "15", "--model", "mlp", "--batch-size", "32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"## OpenMP teams: mlp, batch 32, {rounds} rounds of 15 steps"
    rows = [line for line in lines if line.startswith("| ")][1:]  # past the header
    table = {cells[0]: cells[1:] for cells in (row.strip("| ").split(" | ") for row in rows)}
    assert list(table) == list(omp_teams.MODES)

    # Every round runs each mode once, in a fresh process, with the flags asked for.
    assert len(children) == rounds * len(omp_teams.MODES)
    measured: dict[str, list[dict]] = {m: [] for m in omp_teams.MODES}
    for r in range(rounds):
        ran = []
        for cmd, result in children[r * 3:(r + 1) * 3]:
            assert cmd[cmd.index("--steps") + 1] == "15" and cmd[cmd.index("--model") + 1] == "mlp"
            assert cmd[cmd.index("--batch-size") + 1] == "32"
            mode = cmd[cmd.index("--child") + 1]
            ran.append(mode)
            measured[mode].append(result)
        assert sorted(ran) == sorted(omp_teams.MODES), f"round {r} ran {ran}"

    # What the table claims is what the children measured, round by round.
    cpus = os.cpu_count() or 1
    main_ms = [x["step_ms"] for x in measured["main"]]
    for mode, (step_ms, ratio, cores, per_round) in table.items():
        ms = [x["step_ms"] for x in measured[mode]]
        assert all(m > 0 for m in ms), (mode, ms)
        # process CPU time over the steps' wall time: at most every CPU busy. Slack for CPU spent between
        # timed steps (idle OpenMP workers spinning); a unit or window mix-up would be off by far more.
        assert all(0 < x["cores"] <= 1.5 * cpus for x in measured[mode]), (mode, measured[mode], cpus)
        assert per_round.split() == [f"{m:.1f}" for m in ms], (mode, per_round, ms)
        assert float(step_ms) == pytest.approx(statistics.median(ms), abs=0.051), (mode, step_ms, ms)
        # "x main": this mode's step time over main's in the same round, median over rounds
        want = statistics.median(a / b for a, b in zip(ms, main_ms, strict=True))
        assert float(ratio) == pytest.approx(want, abs=0.00051), (mode, ratio, ms, main_ms)
        assert float(cores) == pytest.approx(statistics.median(x["cores"] for x in measured[mode]), abs=0.0051)


def test_bad_flags_exit_2():
    with pytest.raises(SystemExit) as e:
        omp_teams.main(["--rounds", "0"])
    assert e.value.code == 2
