"""The protection setups of the harness: ``-token`` and ``-open`` setups (the protections on and off) and
the ratio between them."""

from __future__ import annotations

import pytest

from benchmarks.harness import setups, targets, workers
from psserver.common import torch_rpc


def test_token_and_open_setups_build_their_command_lines():
    on, off = setups.parse_setup("ps-pushpull-async-2-token"), setups.parse_setup("ps-pushpull-async-2-open")
    assert (on.guard, off.guard) == ("token", "open") and setups.parse_setup("ps-async-2").guard is None
    assert setups.server_key(on) != setups.server_key(off)  # never one server for both
    for setup, flags in ((on, ["--join-token", setups.BENCH_TOKEN]), (off, ["--no-allowlist"])):
        for argv in (setups.server_argv(setup, model="m", port=7, devices=None, tp_channels="default"),
                     setups.trainer_argv(setup, 0, port=7, batch_size=8, steps=9, stats_out="s")):
            assert argv[1:3] == ["-m", "benchmarks.harness.workers"] and argv[3:4 + len(flags)] == ["psserver", *flags]
            assert argv[4 + len(flags)] == "--"
    sock = setups.server_argv(setups.parse_setup("ps-pushpull-async-2-sock-token"), model="m", port=7, devices=None,
                              tp_channels="default")
    assert sock[sock.index("--channels") + 1] == "basic" and "--join-token" in sock
    with pytest.raises(ValueError):
        setups.parse_setup("ps-async-2-tokens")


def test_the_wrapper_sets_the_token_and_can_switch_the_allowlist_off(monkeypatch):
    seen = {}
    monkeypatch.setattr(torch_rpc, "restrict_unpickler", torch_rpc.restrict_unpickler)  # restored afterwards
    monkeypatch.delenv("PSSERVER_JOIN_TOKEN", raising=False)
    import psserver.cli

    monkeypatch.setattr(psserver.cli, "main", lambda argv: seen.setdefault("argv", argv) and 0)
    workers.run_psserver(["--join-token", "T", "--no-allowlist", "--", "serve", "--port", "1"])
    import os

    assert seen["argv"] == ["serve", "--port", "1"] and os.environ["PSSERVER_JOIN_TOKEN"] == "T"
    assert torch_rpc.restrict_unpickler() is None and torch_rpc.restrict_unpickler.__name__ == "<lambda>"
    monkeypatch.delenv("PSSERVER_JOIN_TOKEN")


def test_the_protections_ratio_pairs_each_token_setup_with_its_open_twin():
    paired = {"setups": {"ps-a-token": {"samples_per_s": [98.0, 99.0, 97.0]},
                         "ps-a-open": {"samples_per_s": [100.0, 100.0, 100.0]},
                         "ps-b-token": {"samples_per_s": [90.0]}}}
    (row,) = targets.protection_ratios(paired)
    assert row["value"] == pytest.approx(0.98) and row["target"] == 0.97 and row["met"]
    assert targets.protection_ratios({"error": "x"}) == []


def test_the_allowlist_cost_benchmark_reads_both_messages_with_both_unpicklers(capsys):
    from benchmarks.studies import allowlist_cost

    assert allowlist_cost.main(["--model", "mlp", "--rounds", "2", "--reps", "5"]) == 0
    assert "per message: torch" in capsys.readouterr().out
