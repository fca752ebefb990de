"""The readers study's tables come from its JSON alone, and bad flags are one line."""

from __future__ import annotations

import pytest

from benchmarks.studies import readers

RESULT = {"model": "mnist_cnn", "readers": 8, "share": True, "dtype": "float32", "publish_interval_s": 0.25,
          "rows": 0, "lookups_per_s": None, "rounds": 2, "window_s": 20.0, "batch_size": 64, "cores": 2,
          "load_average": [4.9, 4.0, 3.0], "throughput_ratio": 0.92, "throughput_ratios": [0.9, 0.94],
          "age_p50_s": 0.07, "age_p99_s": 0.175, "reads": 1200, "versions_copied": 150,
          "copies_sent_per_version": 1.0, "model_bytes": 1_700_000, "rounds_raw": [], "command": "python -m x"}


def test_the_versions_table_says_freshness_cost_and_copies():
    md = readers.markdown(RESULT)
    assert "| mnist_cnn | 8 | yes | bytes | float32 | 0.920 | 0.900 0.940 | 0.070 | 0.175 | 1200 | 1.00 |" in md
    assert "Cores kept busy" not in md  # a run from before they were measured
    busy = {"cores_busy_alone": {"server": 0.9, "trainers": 1.05, "readers": 0.0},
            "cores_busy_with_readers": {"server": 0.88, "trainers": 1.0, "readers": 0.07}}
    md = readers.markdown({**RESULT, **busy, "server_files": True})
    assert "| mnist_cnn | 8 | yes | the server's file | float32 |" in md
    assert "training alone: server 0.90 trainers 1.05 readers 0.00; with the readers: server 0.88 trainers 1.00 " \
           "readers 0.07." in md


def test_the_row_lookups_table():
    md = readers.markdown({**RESULT, "model": "dlrm_tiny", "readers": 2, "rows": 64, "lookups_per_s": 230.0,
                           "age_p50_s": 0.0083, "age_p99_s": 0.0188, "copies_sent_per_version": None})
    assert "| dlrm_tiny | 2 | 64 | 0.920 | 0.900 0.940 | 8.30 | 18.80 | 230 |" in md


def test_bad_flags_are_one_line(capsys):
    with pytest.raises(SystemExit) as bad:
        readers.main(["--readers", "0"])
    assert bad.value.code == 2 and "--readers and --rounds must be at least 1" in capsys.readouterr().err
