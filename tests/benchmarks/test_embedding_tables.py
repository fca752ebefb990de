"""``benchmarks.studies.embedding.tables`` (with its ``embedding_*`` parts): the pure parts
always run; the quick run needs root, ``ip`` and ``tc`` (namespaces, veth links, shapers) and is
skipped, with the reason, where ``multihost.available()`` says no. It only reaches the addresses
of the topologies it builds, and leaves no namespace or process behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.harness import measure, multihost
from benchmarks.studies.embedding import hosts as eh
from benchmarks.studies.embedding import measure as em
from benchmarks.studies.embedding import report as er
from benchmarks.studies.embedding import tables as et


def _ours(pid: int) -> list[str]:
    return [n for n in multihost._netns_list() if multihost.owner_pid(n) == pid]


def test_command_lines_carry_the_tables_flags():
    head = et.server_args(0, 2, host="10.1.2.1", coordinator="10.1.2.1", model="mf", dim=8, prefill=10_000)
    assert "--no-control" not in head and head[head.index("--control-port") + 1] == str(eh.CONTROL_PORT)
    assert head[head.index("--embedding-prefill") + 1] == "10000"
    assert int(head[head.index("--embedding-max-rows") + 1]) > 10_000  # nothing evicted
    other = et.server_args(1, 2, host="10.1.2.2", coordinator="10.1.2.1", model="dlrm_tiny", dim=16)
    assert "--no-control" in other and "--embedding-prefill" not in other
    assert other[other.index("--coordinator") + 1] == "10.1.2.1:29500"
    t = et.trainer_args(1, 2, server="10.1.2.1", batch_size=64, steps=30, dataset="movielens100k", stats_out="s.json")
    assert t[t.index("--step") + 1] == "pushpull" and t[t.index("--dataset") + 1] == "movielens100k"


def test_ideal_bytes_follow_the_trainers_batches():
    torch = pytest.importorskip("torch")
    ids = torch.stack([torch.arange(40) % 7, torch.arange(40) % 11], dim=1)
    ideals = em.step_ideals(ids, rank=0, trainers=2, batch_size=8, steps=5, columns=[(0, 3), (1, 5)])
    assert len(ideals) == 5  # 20 samples per trainer: 3 steps per epoch, the last of 4
    for up, down in ideals:
        assert down % 4 == 0 and up > down
    up, down = ideals[2]  # a batch of 4: at most 4 unique ids per table
    assert down <= 4 * (4 * 3 + 4 * 5)


def test_bytes_window_counts_the_steps_between_two_readings():
    def reading(t: float, received: int, sent: int, packets: int) -> em.Reading:
        return em.Reading(t, {0: em.Count(received, packets, sent, 0)}, {}, (0, 0))

    ends = [[0.1 * i for i in range(1, 31)], [0.1 * i + 0.05 for i in range(1, 31)]]
    ideals = [[(600, 400)] * 30, [(600, 400)] * 30]
    readings = [reading(0.1 * i, 660 * i, 440 * i, 10 * i) for i in range(40)]  # 1100 B per 0.1 s: 2 steps
    leg = em.bytes_window(readings, 0, ends, ideals, batch_size=4, skip=3)
    assert leg["ratio"] == pytest.approx(0.55, rel=0.01)  # 1100 B per 2 steps of 1000
    assert leg["ratio_up"] == pytest.approx(0.55, rel=0.01) and leg["packets_per_step"] == pytest.approx(5, rel=0.01)
    assert leg["header_share"] == pytest.approx(5 * em.HEADER_BYTES / 1000, rel=0.01)


def test_status_series_dates_the_other_servers_counters_by_their_age():
    lines = [{"t": 10.0 + k, "servers": [{"rank": 0, "last_seen_age_seconds": None},
                                         {"rank": 1, "last_seen_age_seconds": 0.5}],
              "tables": [{"server_rank": 0, "table": "a", "lookups": 100 * k, "updates": 90 * k, "rows": 5},
                         {"server_rank": 0, "table": "b", "lookups": 100 * k, "updates": 90 * k, "rows": 5},
                         {"server_rank": 1, "table": "a", "lookups": 50 * k, "updates": 50 * k, "rows": 7}]}
             for k in range(6)]
    lines.append(dict(lines[-1], t=lines[-1]["t"] + 0.1))  # the same watch again, 0.1 s later
    series = em.status_series(lines)
    assert series[0][1] == (11.0, 200, 180, 10) and series[1][1] == (10.5, 50, 50, 7)
    assert len(series[1]) == 6
    assert em.poll_lines('{"error": "x"}\n' + json.dumps(lines[0]) + '\n{"t": 1, "cut') == [lines[0]]


def test_summaries_and_targets():
    setups = [{"name": "a", "role": "rows", "prefill": 10_000, "batch_size": 1024, "label": "10^4 rows"},
              {"name": "b", "role": "rows", "prefill": 10 ** 7, "batch_size": 1024, "label": "10^7 rows"},
              {"name": "c", "role": "batch", "prefill": 10_000, "batch_size": 128, "label": "10^4 rows, batch 128"}]

    def leg(ratio: float, ideal: float) -> dict:
        return {"ratio": ratio, "bytes_per_step": ratio * ideal, "ideal_per_step": ideal}

    runs = {"a": [leg(1.08, 80_000), leg(1.09, 80_000)], "b": [leg(1.08, 80_000), leg(1.12, 80_000)],
            "c": [leg(1.30, 16_000), leg(1.30, 16_000)]}
    summary = er.summarize_bytes(setups, runs)
    assert summary["setups"]["b"]["x_baseline"] == pytest.approx([1.0, 1.12 / 1.09])
    fit = summary["fit"]
    assert fit["fixed_bytes_per_step"] + fit["k"] * 16_000 == pytest.approx(1.30 * 16_000)
    rows = {t["name"]: t for t in er.targets(summary)}
    assert rows["table bytes per trainer step / ideal, 10^4 rows"]["met"] is True
    assert rows["table bytes per trainer step / ideal, 10^7 rows"]["value"] == pytest.approx(1.10)
    assert len(rows) == 3  # no target for the small batch
    rates = {1: [{"total_lookups_per_s": 100.0, "lookups_per_s": [100.0], "samples_per_s": 10.0}],
             2: [{"total_lookups_per_s": 180.0, "lookups_per_s": [90.0, 90.0], "samples_per_s": 18.0}]}
    s = er.summarize_rates([1, 2], rates)
    assert s["setups"][2]["median_x_total_lookups_per_s"] == pytest.approx(1.8)
    assert s["setups"][2]["median_lookups_per_s"] == [90.0, 90.0]


def test_arguments():
    quick = et.parse_args(["--quick"])
    assert (quick.rows, quick.servers, quick.trainers, quick.small_batch, quick.warm_up_steps) == \
        ([10_000, 100_000], [1, 2], 4, 0, 0)
    full = et.parse_args([])
    assert (full.rows, full.servers, full.trainers, full.rounds) == ([10_000, 10_000_000], [1, 2, 4], 8, 3)
    assert "--rows 10000,10000000" in et.command_line(full)
    for bad in (["--servers", "0"], ["--steps", "5"], ["--rate", "0"], ["--rows", "x"],
                ["--skip-bytes", "--skip-rates"]):
        with pytest.raises(SystemExit):
            et.parse_args(bad)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_quick_run_measures_bytes_and_rates_and_leaves_nothing(tmp_path):
    reason = multihost.available()
    if reason:
        pytest.skip(f"no multi-host topology here: {reason}")
    # Shorter than --quick (2 trainers, 80 steps of bytes): the table's shape and the bytes' ratio
    # to the ideal, not the rates' size, are checked (with 20 steps of rates the server's counters
    # were read too few times for a rate). About 40 s on the 2-core VM; the margin is for a machine
    # that other jobs load (beside three other suites, load average 12-17, it took 227 s).
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.studies.embedding.tables", "--quick", "--trainers", "2",
                             "--bytes-steps", "80", "--timeout", "480", "--results-dir", str(tmp_path)],
                            cwd=measure.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=measure.child_env(), start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=530)
    finally:
        if proc.poll() is None:  # its SIGTERM handler stops its children and removes its namespaces
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        multihost.cleanup_stale()
    assert proc.returncode == 0, out[-4000:]
    assert _ours(proc.pid) == []
    result = json.loads((tmp_path / "embedding-tables.json").read_text())
    md = (tmp_path / "embedding-tables.md").read_text()
    assert result["error"] is None and result["bytes"]["error"] is None and result["rates"]["error"] is None
    setups = result["bytes"]["summary"]["setups"]
    assert len(setups) == 2
    for row in setups.values():
        assert 0.9 < row["median_ratio"] < 1.3, row
        assert row["rows_in_table"] >= row["prefill"]
    assert 0.95 < result["targets"][-1]["value"] < 1.05  # bytes / ideal: the same whatever the rows
    rates = result["rates"]["summary"]["setups"]
    assert set(rates) == {"1", "2"}  # JSON keys
    for s, row in rates.items():
        assert row["median_total_lookups_per_s"] > 0 and row["median_total_updates_per_s"] > 0
        assert len(row["median_lookups_per_s"]) == int(s) and all(v > 0 for v in row["median_lookups_per_s"])
    assert "### (A)" in md and "### (B)" in md and "| 2 |" in md
