"""Paired rounds (``benchmarks.harness.paired``): the arithmetic on fabricated step times
(``benchmarks.harness.paired_stats``), the flags, and one short real measurement against live servers."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import psutil
import pytest

from benchmarks.harness import netns, paired, paired_stats, report, setups
from tests import forked


def test_leg_rate_counts_only_while_every_process_steps():
    # Trainer 0 steps every 0.1 s for 2 s; trainer 1 starts at 0.5 s and stops at 1.5 s.
    t0 = [0.1 * i for i in range(1, 21)]
    t1 = [0.5 + 0.1 * i for i in range(1, 11)]
    leg = paired_stats.leg_rate([t0, t1], batch_size=10, skip=2)
    # After 2 skipped steps each: trainer 0 from 0.3 s, trainer 1 from 0.8 s; together until 1.5 s.
    assert leg["seconds"] == pytest.approx(0.7)
    assert leg["steps"] == 14  # 7 steps each in (0.8, 1.5]
    assert leg["samples_per_s"] == pytest.approx(14 * 10 / 0.7)
    assert leg["step_ms"] == pytest.approx(100.0)
    with pytest.raises(RuntimeError, match="too few"):
        paired_stats.leg_rate([t0[:7]], batch_size=10, skip=2)
    # A loaded machine ran them one after the other: each one's own rate, summed, flagged (no failure).
    apart = paired_stats.leg_rate([t0[:10], [5 + t for t in t0[:10]]], batch_size=10, skip=0)
    assert apart["samples_per_s"] == pytest.approx(2 * 10 * 10) and "never stepped together" in apart["disturbed"]


def _leg(rate: float) -> dict:
    return {"samples_per_s": rate, "step_ms": 64_000 / rate, "steps": 60, "seconds": 1.0}


def test_summarize_divides_by_the_best_local_loop_of_each_round():
    names = setups.parse_setups("local,local-cached,ps-async-1")
    runs = {"local": [_leg(1000), _leg(800), _leg(900)],
            "local-cached": [_leg(950), _leg(1000), _leg(880)],
            "ps-async-1": [_leg(940), _leg(850), _leg(855)]}
    out = paired_stats.summarize(names, runs)
    assert out["ceiling_per_round"] == ["local", "local-cached", "local"]
    ps = out["setups"]["ps-async-1"]
    assert ps["x_local"] == pytest.approx([0.94, 0.85, 0.95])
    assert ps["median_x_local"] == pytest.approx(0.94)
    assert ps["median_samples_per_s"] == 855
    assert ps["rounds_at_or_above_0.90"] == 2
    assert out["setups"]["local"]["x_local"] == pytest.approx([1.0, 0.8, 1.0])
    table = "\n".join(report.markdown_rows({**out, "rounds": 3}))
    assert "| ps-async-1 | 855 | 0.940 | 2/3 | 0.940 0.850 0.950 |" in table


def test_a_leg_whose_trainers_took_another_path_than_asked_is_an_error():
    staged = setups.parse_setup("ps-pull-async-1-staged")
    assert paired.check_transports(staged, [{"kind": "staged", "fell_back": None}] * 2) == ["staged"]
    with pytest.raises(RuntimeError, match="asked --transport staged, the trainers took cpu"):
        paired.check_transports(staged, [{"kind": "cpu", "fell_back": None}])
    auto = setups.parse_setup("ps-pull-async-1")
    with pytest.raises(RuntimeError, match=r"device map failed its probe \(no CUDA IPC\)"):
        paired.check_transports(auto, [{"kind": "device-map", "fell_back": None},
                                       {"kind": "staged", "fell_back": "no CUDA IPC"}])
    assert paired.check_transports(auto, [None]) == []


def test_flags_are_checked(capsys):
    steps = "need --rounds >= 1, --batch-size >= 1, --skip >= 0, --steps >= --skip + 6"
    qdisc = "--qdisc needs --netns on and a qdisc"
    for argv, message in (
            (["--setups", "local,fsdp-2"], "--setups: only local, PS and DDP setups run in paired rounds, not fsdp-2"),
            (["--setups", "ps-async-1"], "--setups: name at least one single local loop"),
            (["--setups", "local,local"], "--setups: setup named twice: local"),
            (["--setups", "local,ps-pushpull-async-1-staged"],
             "--setups: ps-pushpull-async-1-staged: -staged and -hostcopy choose a GPU trainer's transport; give "
             "--trainer-device cuda:N"),
            (["--steps", "10", "--skip", "5"], steps), (["--rounds", "0"], steps),
            (["--setups", "local,ps-turbo-1"], "--setups: unknown setup 'ps-turbo-1': use local, local-cached"),
            (["--qdisc", "tbf rate 1gbit burst 256kb latency 100ms"], qdisc),
            (["--netns", "on", "--qdisc", " "], qdisc)):
        with pytest.raises(SystemExit) as e:
            paired.parse_args(argv)
        assert e.value.code == 2, argv
        err = capsys.readouterr().err
        assert f"error: {message}" in err and "Traceback" not in err, argv
    gpu = paired.parse_args(["--setups", "gpu", "--trainer-device", "cuda:0", "--devices", "cuda:0", "--netns", "off"])
    assert {s.transport for s in gpu.setups} == {None, "staged", "cpu"}
    args = paired.parse_args(["--setups", "local-cached, ps-chained-async-2"])
    assert [s.name for s in args.setups] == ["local-cached", "ps-chained-async-2"]
    with pytest.raises(ValueError, match="fsdp-2"):
        paired.measure_rounds(setups.parse_setups("local,fsdp-2"), rounds=1, model="mnist_cnn", batch_size=8,
                              steps=10, skip=2)


def _psserver_children() -> list[psutil.Process]:
    """This process's descendants but the tests' fork server and its resource tracker (``tests.forked``)."""
    helpers = forked.helper_pids()
    return [c for c in psutil.Process().children(recursive=True) if c.is_running() and c.pid not in helpers]


def test_every_setup_leads_one_round():
    names = setups.parse_setups("local,ps-async-1,ddp-2")
    orders = [[s.name for s in paired.round_order(names, r)] for r in range(4)]
    assert orders == [["local", "ps-async-1", "ddp-2"], ["ps-async-1", "ddp-2", "local"],
                      ["ddp-2", "local", "ps-async-1"], ["local", "ps-async-1", "ddp-2"]]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_rounds_run_every_setup_against_live_servers(tmp_path):
    names = ["local", "ps-chained-async-1-sock", "ps-pushpull-async-2-straggler", "ddp-2-straggler"]
    # 30 steps: the fastest setup (chained, one trainer, ~30 ms a step) then spans enough of the
    # probe's 0.1 s readings for a slope (3 at least); 14 steps sometimes gave two. One round:
    # the rotation of later rounds is test_every_setup_leads_one_round.
    argv = ["--rounds", "1", "--steps", "30", "--skip", "4", "--warm-up-steps", "6", "--setups", ",".join(names),
            "--results-dir", str(tmp_path)]
    assert paired.main(argv) == 0
    result = json.loads((tmp_path / "paired-mnist_cnn-b64.json").read_text())
    p = result["paired"]
    assert p["rounds"] == 1 and p["steps"] == 30 and p["skip"] == 4
    assert p["order_per_round"] == [names]
    assert p["ceiling_per_round"] == ["local"]
    for name, row in p["setups"].items():
        assert len(row["samples_per_s"]) == 1 and all(r > 0 for r in row["samples_per_s"]), name
        assert len(row["x_local"]) == 1 and row["median_x_local"] > 0, name
        assert all(ms > 0 for ms in row["step_ms"]), name
    assert p["setups"]["local"]["x_local"] == [1.0]
    # DDP runs and -sock PS runs count their bytes (a PS run without -sock moves its tensors with
    # cma, outside the sockets: none); PS runs the server's CPU; stragglers are held.
    for name in names[1:]:
        if name == "ps-pushpull-async-2-straggler":
            assert "median_bytes_per_step" not in p["setups"][name]
        else:
            assert p["setups"][name]["median_bytes_per_step"] > 0, name
        assert (p["setups"][name].get("median_server_cpu_ms_per_step") or 0) > 0 or name.startswith("ddp"), name
    for name in names[2:]:
        assert all(leg["throttle"] in ("cgroup1", "cgroup2", "sigstop") for leg in p["runs"][name]), name
        assert all(len(leg["steps_per_process"]) == 2 for leg in p["runs"][name]), name
    md = (tmp_path / "paired-mnist_cnn-b64.md").read_text()
    assert "| ps-chained-async-1-sock |" in md and result["command"] in md
    assert "straggler at half a core: PS async, --step pushpull / DDP 2 ranks" in md
    assert not _psserver_children()  # servers and trainers all stopped
    assert not [n for n in netns_names() if n.startswith(f"{netns.PREFIX}{os.getpid()}-")]  # namespace deleted


def netns_names() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout if shutil.which("ip") else ""
    return [line.split()[0] for line in out.splitlines() if line.split()]
