"""The benchmark harness: its analysis on fabricated data (fast) and one real ``--quick`` run
(slow) whose outputs are checked for shape, not speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import measure, report, run

ROOT = Path(__file__).resolve().parents[2]

SS_OUTPUT = """\
ESTAB 0      0      127.0.0.1:40000 127.0.0.1:50000 users:(("python",pid=11,fd=5))
\t cubic wscale:7,7 rto:204 bytes_sent:1000 bytes_acked:1001 bytes_received:50 segs_out:5
ESTAB 0      0      127.0.0.1:50000 127.0.0.1:40000 users:(("python",pid=22,fd=7),("python",pid=23,fd=7))
\t cubic wscale:7,7 rto:204 bytes_sent:50 bytes_received:1000 segs_out:5
ESTAB 0      0      127.0.0.1:40001 127.0.0.1:50001 users:(("python",pid=99,fd=5))
\t cubic bytes_received:7
"""


def test_parse_ss_and_bytes_between():
    conns = measure.parse_ss(SS_OUTPUT)
    assert conns[("127.0.0.1:40000", "127.0.0.1:50000")] == {"pids": {11}, "sent": 1000, "received": 50}
    assert conns[("127.0.0.1:50000", "127.0.0.1:40000")]["pids"] == {22, 23}
    assert conns[("127.0.0.1:40001", "127.0.0.1:50001")]["sent"] == 0
    a = {("x", "y"): 100, ("y", "x"): 10}
    b = {("x", "y"): 300, ("y", "x"): 10, ("z", "w"): 5}  # a new connection counts from zero
    assert measure.bytes_between(a, b) == 205


def test_analyze_steps_two_processes():
    # Two processes at 10 steps/s each, the second starting 1 s later, batch 8: 160 samples/s.
    ends = [[0.1 * i for i in range(1, 101)], [1.0 + 0.1 * i for i in range(1, 101)]]
    a = measure.analyze_steps(ends, 8, warmup_s=1.0, warmup_steps=3, window_s=1.0)
    assert a.start == pytest.approx(2.1) and a.end == pytest.approx(10.0)
    assert a.samples_per_s == pytest.approx(160, rel=0.1)
    assert measure.percentile(a.latencies_s, 0.5) == pytest.approx(0.1)
    with pytest.raises(ValueError):
        measure.analyze_steps([[0.1, 0.2]], 8, warmup_s=1.0)


def test_wire_bytes_per_step_uses_snapshots_inside_the_window():
    samples = [measure.Sample(t, {}, {}, {("a", "b"): int(t * 1000)}) for t in (0.0, 1.0, 2.0, 3.0, 4.0)]
    ends = [[0.5 * i for i in range(1, 9)]]  # 2 steps/s
    w = measure.wire_bytes_per_step(samples, ends, 1.0, 3.0)
    assert w["steps"] == 4 and w["bytes_per_step"] == pytest.approx(500)
    assert measure.wire_total_bytes(samples) == 4000


def test_setup_names_and_lower_bound():
    assert run.parse_setup("ps-sync-4") == {"name": "ps-sync-4", "kind": "ps", "trainers": 4, "update": "sync",
                                            "step": "plain"}
    assert run.parse_setup("ps-fused-async-2")["step"] == "fused"
    chained = run.parse_setup("ps-chained-sync-2")
    assert chained["step"] == "chained" and chained["update"] == "sync" and chained["trainers"] == 2
    assert run.parse_setup("ps-fold-async-1")["step"] == "fold"
    with pytest.raises(ValueError, match="unknown setup"):
        run.parse_setup("ps-folded-async-1")
    assert run.parse_setup("local-1t")["threads"] == 1
    assert run.parse_setup("local-1t")["allocator"] == run.parse_setup("local")["allocator"] == "system"
    assert run.parse_setup("local-cached")["allocator"] == "cached"  # the server's policy, in the ceiling
    assert run.parse_setup("fsdp-2")["kind"] == "fsdp"
    with pytest.raises(ValueError):
        run.parse_setup("ps-2")
    # mnist_cnn, batch 64: 64 x 784 floats in, 64 x 10 logits out, their gradient back.
    assert run.lower_bound("mnist_cnn", 64) == {"input": 200704, "output": 2560, "grad_output": 2560, "total": 205824}


def _check_result(result: dict, md: str, png: Path, setups: list[str]) -> None:
    for key in ("command", "machine", "devices_used", "config", "lower_bound", "setups", "ratios", "time"):
        assert key in result, key
    m = result["machine"]
    for key in ("cores_logical", "torch", "gpus", "load_avg_start", "load_avg_end"):
        assert key in m, key
    assert [s["name"] for s in result["setups"]] == setups
    for s in result["setups"]:
        assert not s.get("error"), s
        for key in ("samples_per_s", "ratio_to_local", "step_p50_ms", "step_p95_ms", "bytes_per_step",
                    "peak_rss_mb", "devices"):
            assert key in s, (s["name"], key)
        assert s["samples_per_s"] > 0
    ps = [s for s in result["setups"] if s["kind"] == "ps"]
    assert all(s["bytes_per_step"] > 0 and "bytes_vs_lower_bound" in s for s in ps)
    assert all("server_train_cpu_pct" in s for s in ps)
    assert any(s.get("server_idle_cpu_pct") is not None for s in ps)
    names = [r["name"] for r in result["ratios"]]
    assert any("1 trainer" in n for n in names) and any("idle CPU" in n for n in names)
    assert all(r["value"] is not None for r in result["ratios"])
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    for name in setups:
        assert any(row.startswith(f"| {name} |") for row in rows), name
    assert result["command"] in md
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_quick_run_writes_json_table_and_chart(tmp_path):
    pytest.importorskip("matplotlib")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.run", "--quick", "--results-dir", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=280, env=measure.child_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "latest.json").read_text())
    md = (tmp_path / "latest.md").read_text()
    _check_result(result, md, tmp_path / "latest.png", run.QUICK_SETUPS.split(","))
    stamped = sorted(tmp_path.glob("bench-mnist_cnn-b64-*"))
    assert {p.suffix for p in stamped} == {".json", ".md", ".png"}
    assert result["config"]["quick"] is True
    assert "| local |" in report.markdown(result)


def test_step_variants_arguments_are_checked(capsys):
    from benchmarks import step_variants

    for argv in (["--variants", "fold"], ["--variants", "plain,turbo"], ["--steps", "10", "--skip", "10"]):
        with pytest.raises(SystemExit) as e:
            step_variants.parse_args(argv)
        assert e.value.code == 2
    assert "--variants" in capsys.readouterr().err
    assert step_variants.parse_args(["--variants", "plain, fold"]).variants == ["plain", "fold"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_step_variants_interleaves_against_one_server(tmp_path):
    from benchmarks import step_variants

    argv = ["--rounds", "2", "--steps", "12", "--skip", "3", "--variants", "plain,chained,local",
            "--results-dir", str(tmp_path)]
    assert step_variants.main(argv) == 0
    result = json.loads((tmp_path / "step_variants-mnist_cnn-b64.json").read_text())
    assert set(result["step_ms"]) == {"plain", "chained", "local"}
    assert all(len(v) == 2 and all(ms > 0 for ms in v) for v in result["step_ms"].values())
    assert result["variants"]["plain"]["ratio_to_plain_per_round"] == [1.0, 1.0]
    assert result["variants"]["local"]["x_local_per_round"] == [1.0, 1.0]  # the only local: the ceiling
    chained = result["variants"]["chained"]
    assert chained["median_ratio_to_plain"] > 0 and len(chained["ratio_to_plain_per_round"]) == 2
    assert 0 < chained["median_x_local"] and len(chained["x_local_per_round"]) == 2
    assert "| chained |" in (tmp_path / "step_variants-mnist_cnn-b64.md").read_text()
