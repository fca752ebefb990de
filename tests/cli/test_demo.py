"""``psserver demo``: its flags are checked before it starts any process."""

from __future__ import annotations

import subprocess

import pytest

import psserver.cli.demo as demo
from psserver.cli import main


@pytest.fixture
def no_processes(monkeypatch):
    def popen(*args, **kwargs):
        raise AssertionError(f"demo started a process: {args[0] if args else kwargs}")

    monkeypatch.setattr(demo.subprocess, "Popen", popen)
    assert demo.subprocess is subprocess


def _cases(tmp_path):
    (tmp_path / "afile").write_text("")
    return [
        # Each started a server, then ended rc 1 with "trainer 0 accuracy failed".
        (["--epochs", "0"], "--epochs must be >= 1, got 0"),
        (["--dataset", "nosuch"], "unknown dataset 'nosuch'"),
        (["--train-split", "-1"], "--train-split must be positive, got -1"),
        (["--train-split", "0"], "--train-split must be positive, got 0"),  # was dropped, silently
        (["--dataset", "mnist", "--data-dir", str(tmp_path / "afile")], "does not exist"),
        # Spawned 100000 trainers.
        (["--trainers", "100000"], "--trainers must be in 1..16 (each is a process on this host), got 100000"),
        (["--trainers", "0"], "--trainers must be in 1..16"),
    ]


@pytest.mark.timeout(120)
def test_bad_trainer_flags_are_one_line_before_anything_starts(no_processes, capsys, tmp_path):
    for flags, fragment in _cases(tmp_path):
        assert main(["demo", *flags]) == 2, flags
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("psserver demo: error: ") and fragment in err[0], (flags, err)
