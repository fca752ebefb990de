"""``python -m benchmarks diloco``: its setups, time to target and summary (the runs themselves
are the study's; its quick run is in docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from benchmarks.studies import diloco


def test_setups_are_parsed_by_name():
    assert diloco.parse_setup("ddp-4") == diloco.Setup("ddp-4", "ddp")
    assert diloco.parse_setup("diloco-async-H100-straggler") == diloco.Setup("diloco-async-H100-straggler", "diloco",
                                                                              "async", 100, True)
    assert diloco.parse_setup("diloco-sync-H50-int4").compress == "int4"
    with pytest.raises(ValueError, match="unknown setup 'diloco-H5'"):
        diloco.parse_setup("diloco-H5")
    args = diloco.parse_args(["--quick"])
    assert [s.name for s in args.setups] == list(diloco.QUICK_SETUPS) and args.steps == 24


def test_time_to_target_is_linear_between_snapshots_and_none_when_never_reached():
    rows = [{"seconds": 0, "samples": 0, "loss": 5.0}, {"seconds": 10, "samples": 100, "loss": 3.0},
            {"seconds": 20, "samples": 200, "loss": 2.0}]
    assert diloco.time_to(rows, 2.5, "seconds") == 15 and diloco.time_to(rows, 2.5, "samples") == 150
    assert diloco.time_to(rows, 6.0, "seconds") == 0 and diloco.time_to(rows, 1.0, "seconds") is None


def test_the_default_target_is_the_highest_final_loss_without_a_straggler():
    def run(name, final):
        return {"setup": name, "trained_s": 1.0, "bytes_per_sample": 1.0, "step_rates": None,
                "snapshots": [{"seconds": 0, "samples": 0, "loss": 5.0}, {"seconds": 9, "samples": 90, "loss": final}]}

    summary = diloco.summarize([run("ddp-4", 2.0), run("diloco-sync-H8", 2.5), run("diloco-sync-H8-straggler", 4.0)],
                               None)
    assert summary["target_loss"] == 2.5
    assert summary["setups"]["diloco-sync-H8"]["seconds_to_target"] == 9
    assert summary["setups"]["diloco-sync-H8-straggler"]["seconds_to_target"] is None
