"""``python -m benchmarks diloco``: its setups, time to target and summary (the runs themselves
are the study's; its quick run is in docs/benchmarks.md)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from benchmarks.studies import diloco


def test_setups_are_parsed_by_name():
    assert diloco.parse_setup("ddp-4") == diloco.Setup("ddp-4", "ddp")
    assert diloco.parse_setup("diloco-async-H100-straggler") == diloco.Setup("diloco-async-H100-straggler", "diloco",
                                                                              "async", 100, True)
    assert diloco.parse_setup("diloco-sync-H50-int4").compress == "int4"
    streaming = diloco.parse_setup("diloco-sync-H50-F4-int8")
    assert (streaming.fragments, streaming.compress, streaming.local_steps) == (4, "int8", 50)
    with pytest.raises(ValueError, match="unknown setup 'diloco-H5'"):
        diloco.parse_setup("diloco-H5")
    assert diloco.parse_setup("diloco-sync-H50-faults").faults
    with pytest.raises(ValueError, match="-faults is for a DiLoCo setup"):
        diloco.parse_setup("ddp-4-faults")
    local_sgd = diloco.parse_setup("diloco-sync-H50-F4-outer1-m0")
    assert (local_sgd.fragments, local_sgd.outer_opt) == (4, (1.0, 0.0))
    served = diloco.server_args(local_sgd, diloco.parse_args([]), "10.0.0.1", Path("/x"))
    assert served[served.index("--optimizer"):] == ["--optimizer", "sgd", "--lr", "1", "--momentum", "0"]
    served = diloco.server_args(diloco.parse_setup("diloco-sync-H50-outer0.5-m0.9"), diloco.parse_args([]),
                                "10.0.0.1", Path("/x"))
    assert served[served.index("--optimizer"):] == ["--optimizer", "sgd", "--lr", "0.5", "--momentum", "0.9",
                                                    "--optimizer-args", '{"nesterov": true}']
    with pytest.raises(ValueError, match="-outer is for a DiLoCo setup"):
        diloco.parse_setup("ddp-4-outer1-m0")
    assert diloco.parse_args(["--fault-at", "30,90"]).fault_at == (30.0, 90.0)
    for bad in ("90,30", "30", "a,b"):
        with pytest.raises(SystemExit):
            diloco.parse_args(["--fault-at", bad])
    args = diloco.parse_args(["--quick"])
    assert [s.name for s in args.setups] == list(diloco.QUICK_SETUPS) and args.steps == 24


def test_ddp_ranks_take_their_share_of_the_cores_as_the_trainers_do(monkeypatch):
    # Each rank's namespace says LOCAL_WORLD_SIZE=1: without --compute-threads every rank took
    # all the cores and four OpenMP teams spun on two (DDP's steps 10x slower than its compute).
    monkeypatch.setattr(diloco, "usable_cpus", lambda: 8)
    argv = diloco.ddp_args(diloco.parse_setup("ddp-4"), diloco.parse_args(["--trainers", "4"]), Path("/x"))
    assert argv[argv.index("--compute-threads") + 1] == "2"
    monkeypatch.setattr(diloco, "usable_cpus", lambda: 2)
    argv = diloco.ddp_args(diloco.parse_setup("ddp-4"), diloco.parse_args(["--trainers", "4"]), Path("/x"))
    assert argv[argv.index("--compute-threads") + 1] == "1"


def test_a_failure_is_summed_up_by_its_first_line_and_the_processs_last():
    why = "ddp-4: rank0 exited with 2:\nstarting\npsserver train: error: --dataset pysource: 131072 asked\n"
    assert diloco._why(why) == "ddp-4: rank0 exited with 2: psserver train: error: --dataset pysource: 131072 asked"
    assert diloco._why("setup timed out") == "setup timed out"


def test_time_to_target_is_linear_between_snapshots_and_none_when_never_reached():
    rows = [{"seconds": 0, "samples": 0, "loss": 5.0}, {"seconds": 10, "samples": 100, "loss": 3.0},
            {"seconds": 20, "samples": 200, "loss": 2.0}]
    assert diloco.time_to(rows, 2.5, "seconds") == 15 and diloco.time_to(rows, 2.5, "samples") == 150
    assert diloco.time_to(rows, 6.0, "seconds") == 0 and diloco.time_to(rows, 1.0, "seconds") is None


def _run(name: str, final: float, samples: int = 90, seconds: float = 9.0, bytes_per_sample: float = 1.0) -> dict:
    return {"setup": name, "trained_s": seconds, "samples": samples, "bytes_per_sample": bytes_per_sample,
            "step_rates": None, "snapshots": [{"seconds": 0, "samples": 0, "loss": 5.0},
                                              {"seconds": seconds, "samples": samples, "loss": final}]}


def test_the_default_target_is_the_highest_final_loss_without_a_straggler():
    summary = diloco.summarize([_run("diloco-sync-H8", 2.0), _run("diloco-async-H8", 2.5),
                                _run("diloco-sync-H8-straggler", 4.0)], None)
    assert summary["target_loss"] == 2.5
    assert summary["setups"]["diloco-async-H8"]["seconds_to_target"] == 9
    assert summary["setups"]["diloco-sync-H8-straggler"]["seconds_to_target"] is None


def test_with_ddp_the_target_is_its_final_loss_and_each_setup_is_compared_to_it_at_its_samples():
    """DDP ends at 3.0 after 100 samples in 50 s; DiLoCo (5.0 to 1.0 over 400 samples and 20 s)
    passes 3.0 at 10 s and is at 4.0 at 100 samples, a third worse; pushpull never reaches it in
    40 s: DiLoCo is at least 4x sooner."""
    diloco_run = _run("diloco-sync-H50", 1.0, samples=400, seconds=20.0, bytes_per_sample=10.0)
    runs = [_run("ddp-4", 3.0, samples=100, seconds=50.0), diloco_run,
            _run("pushpull-async-4", 4.0, samples=40, seconds=40.0, bytes_per_sample=500.0)]
    summary = diloco.summarize(runs, None)
    assert summary["target_loss"] == 3.0 and summary["ddp_samples"] == 100
    row = summary["setups"]["diloco-sync-H50"]
    assert row["seconds_to_target"] == 10 and row["loss_at_ddp_samples"] == 4.0
    assert row["vs_ddp_loss"] == pytest.approx(1 / 3)
    assert row["sooner_than_ddp"] == {"ratio": 5.0, "at_least": False}
    assert row["sooner_than_pushpull"] == {"ratio": 4.0, "at_least": True}
    assert row["fewer_bytes_than_pushpull"] == 50
    assert summary["setups"]["pushpull-async-4"]["loss_at_ddp_samples"] is None  # it stopped before
    # DiLoCo ends at 1.0 (20 s); DDP, ending at 3.0, never got there: no ratio.
    assert row["ddp_to_its_loss"] is None
    # Pushpull ends at 4.0 at 40 s, which DDP passed at 25 s: DDP took 0.625 times as long.
    assert summary["setups"]["pushpull-async-4"]["ddp_to_its_loss"] == pytest.approx(0.625)
    assert "| diloco-sync-H50 | 1.000 | 4.000 | +33.3% | 20 | 10 | 5.0x | - | >= 4.0x |" in diloco.markdown(
        {"config": {"trainers": 4, "rate": 100.0, "delay_ms": 0.0, "steps": 10, "batch_size": 8, "lr": 1e-3},
         "command": "c", "time": "t", "wall_s": 60.0, "cpus": 2, "load_before": 0.1, "runs": runs})
    # Pushpull stopped (40 s) before DDP reached the target (50 s): no bound.
    assert summary["setups"]["ddp-4"]["sooner_than_pushpull"] is None
    assert summary["setups"]["pushpull-async-4"]["fewer_bytes_than_pushpull"] is None


def test_a_run_of_ddps_steps_and_batches_is_compared_by_its_final_loss():
    # 3,000 steps of 4 trainers x 8: DDP counts 96,000 samples; the server counted 95,992 (each
    # epoch's short last batch as it was). A run stopped early, or of other steps, is not compared.
    def run(name: str, final: float, counted: int, samples: int = 96000, stopped: list | None = None) -> dict:
        r = _run(name, final, samples=counted)
        return {**r, "samples": samples, "stopped": stopped or []}

    runs = [_run("ddp-4", 1.38, samples=96000), run("diloco-sync-H50", 1.40, 95992),
            run("diloco-sync-H10", 1.39, 95000, samples=95040), run("diloco-async-H50", 1.5, 95000, stopped=[3])]
    rows = diloco.summarize(runs, None)["setups"]
    assert rows["diloco-sync-H50"]["loss_at_ddp_samples"] == 1.40
    assert rows["diloco-sync-H50"]["vs_ddp_loss"] == pytest.approx(1.40 / 1.38 - 1)
    assert rows["diloco-sync-H10"]["loss_at_ddp_samples"] is None
    assert rows["diloco-async-H50"]["loss_at_ddp_samples"] is None


def test_steps_of_overrides_a_named_setups_steps_and_refuses_others():
    args = diloco.parse_args(["--setups", "ddp-4,diloco-sync-H50", "--steps", "600", "--steps-of", "ddp-4=200"])
    assert [diloco.steps(s, args) for s in args.setups] == [200, 600]
    with pytest.raises(SystemExit):
        diloco.parse_args(["--setups", "ddp-4", "--steps-of", "ddp-5=3"])


class _Proc:
    def __init__(self, name: str, runs_for: float) -> None:
        self.name, self.until, self.stops = name, time.monotonic() + runs_for, 0

    def running(self) -> bool:
        return time.monotonic() < self.until

    def wait(self, timeout: float) -> int:
        return 0

    def stop(self, timeout: float) -> int:
        self.stops += 1
        self.until = 0.0
        return 143


def test_a_straggler_is_stopped_once_the_others_are_done_and_everyone_at_the_time_limit():
    args = diloco.parse_args(["--setups", "diloco-async-H8-straggler", "--time-limit", "60"])
    procs = [_Proc("trainer0", 0.2), _Proc("trainer1", 0.3), _Proc("trainer2", 1000)]
    assert diloco.wait_trainers(procs, args.setups[0], args, time.time()) == ["trainer2"]
    assert [p.stops for p in procs] == [0, 0, 1]
    args = diloco.parse_args(["--setups", "diloco-sync-H8", "--time-limit", "0.5"])
    procs = [_Proc("trainer0", 0.1), _Proc("trainer1", 1000)]
    assert diloco.wait_trainers(procs, args.setups[0], args, time.time()) == ["trainer1"]


def test_a_rerun_replaces_its_setups_runs_in_the_earlier_result_and_refuses_another_configuration():
    config = {"trainers": 4, "batch_size": 8, "lr": 1e-3, "rate": 100.0, "train_samples": 10, "eval_samples": 4,
              "snapshot_s": 20.0, "straggler_share": 0.1, "steps": 600, "steps_of": {"ddp-4": 200}}
    earlier = {"command": "first", "config": config, "runs": [_run("ddp-4", 3.0), _run("diloco-sync-H50", 2.0)]}
    rerun = {"command": "again", "time": "t", "wall_s": 60.0, "load_before": 0.5,
             "config": {**config, "steps_of": {"ddp-4": 300}}, "runs": [_run("ddp-4", 2.5)]}
    merged = diloco.rerun_into(earlier, rerun)
    assert [(r["setup"], r["snapshots"][-1]["loss"]) for r in merged["runs"]] == [("ddp-4", 2.5),
                                                                                  ("diloco-sync-H50", 2.0)]
    assert merged["command"] == "first" and [r["command"] for r in merged["reruns"]] == ["again"]
    assert merged["config"]["steps_of"] == {"ddp-4": 300}
    # Run again without --steps-of: it took the rerun's --steps, the earlier result's (600).
    again = diloco.rerun_into(earlier, {**rerun, "config": {**config, "steps_of": {}}})
    assert again["config"]["steps_of"] == {}
    # A result from before --model was byte_lm's: a rerun of byte_lm goes into it, of mnist_cnn not.
    assert diloco.rerun_into(earlier, {**rerun, "config": {**config, "model": "byte_lm"}})["runs"]
    with pytest.raises(SystemExit, match=r"ran another configuration \(model\)"):
        diloco.rerun_into(earlier, {**rerun, "config": {**config, "model": "mnist_cnn"}})
    with pytest.raises(SystemExit, match=r"ran another configuration \(rate\)"):
        diloco.rerun_into(earlier, {**rerun, "config": {**config, "rate": 50.0}})


def test_a_straggler_is_timed_against_its_equal_trainers_to_the_higher_of_their_final_losses():
    equal = _run("diloco-async-H100", 2.0, seconds=10.0)
    slow = _run("diloco-async-H100-straggler", 2.5, seconds=4.0)
    row = diloco.stragglers([equal, slow, _run("diloco-sync-H50-straggler", 3.0)])
    assert list(row) == ["diloco-async-H100-straggler"]  # the sync one has no equal run
    assert row["diloco-async-H100-straggler"]["target_loss"] == 2.5
    assert row["diloco-async-H100-straggler"]["ratio"] == pytest.approx(4.0 / (10.0 * 2.5 / 3.0))  # equal: 2.5 at 8.3 s


def test_a_stopped_trainers_rate_comes_from_its_progress_lines(tmp_path):
    (tmp_path / "trainer3.log").write_text(
        "2026-11-28 21:51:49,891 INFO psserver.utils.progress: trainer 3: step 16/600 loss 3.0106 12 samples/s\n"
        "2026-11-28 21:52:00,000 INFO psserver.trainer.steps.diloco: diloco: 7478016 bytes of pseudo-gradient\n"
        "2026-11-28 21:52:09,891 INFO psserver.utils.progress: trainer 3: step 26/600 loss 2.2704 16 samples/s\n")
    assert diloco.step_rates([tmp_path / "trainer3.json"]) == [pytest.approx(0.5)]


def test_a_render_draws_the_named_setups_records_them_and_refuses_one_it_never_ran(tmp_path, capsys):
    result = tmp_path / "diloco.json"
    result.write_text((Path(diloco.DEFAULT_RESULTS) / "diloco.json").read_text())
    assert diloco.main(["--render", str(result), "--plot-setups", "ddp-4,diloco-sync-H50"]) == 0
    assert json.loads(result.read_text())["config"]["plot_setups"] == ["ddp-4", "diloco-sync-H50"]
    assert (tmp_path / "diloco.png").stat().st_size > 0 and (tmp_path / "diloco.md").exists()
    before = result.read_text()
    assert diloco.main(["--render", str(result), "--plot-setups", "ddp-4,ddp-5"]) == 2
    assert "no run of ddp-5" in capsys.readouterr().err
    assert result.read_text() == before
    with pytest.raises(SystemExit):
        diloco.parse_args(["--plot-setups", "ddp-4"])
