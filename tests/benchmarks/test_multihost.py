"""``benchmarks.harness.multihost``: several hosts on one machine (namespaces, veth links to a bridge,
``tc`` rate limits). The pure parts always run; the real topology needs root, ``ip`` and ``tc``
and is skipped, with the reason, where ``multihost.available()`` says no."""

from __future__ import annotations

import subprocess
import sys

import pytest

from benchmarks.harness import multihost, netns


def _skip_unless_available() -> None:
    reason = multihost.available()
    if reason:
        pytest.skip(f"no multi-host topology here: {reason}")


def _root_links() -> set[str]:
    r = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10, check=True)
    return {line.split(":", 2)[1].strip().split("@")[0] for line in r.stdout.splitlines()}


def _ours(prefix: str) -> list[str]:
    return [n for n in multihost._netns_list() if n.startswith(prefix)]


def test_shaper_commands_cover_both_qdiscs():
    (tbf,) = multihost.shape_commands("eth0", 50)
    assert tbf[:8] == ["qdisc", "replace", "dev", "eth0", "root", "handle", "1:", "tbf"]
    assert tbf[tbf.index("rate") + 1] == "50000kbit" and int(tbf[tbf.index("burst") + 1]) >= 32 * 1024
    qdisc, cls = multihost.shape_commands("v3", 1000, "htb")
    assert "htb" in qdisc and cls[cls.index("rate") + 1] == cls[cls.index("ceil") + 1] == "1000000kbit"
    for bad in ((0, "tbf"), (-5, "tbf"), (10, "netem")):
        with pytest.raises(ValueError):
            multihost.shape_commands("eth0", *bad)


def test_names_and_subnets_belong_to_their_harness():
    assert multihost.owner_pid("psbench-123-m0-hub") == 123
    assert multihost.owner_pid("psbench-123-m4-17") == 123
    assert multihost.owner_pid("psbench-123-0") is None  # benchmarks.harness.netns's own namespaces
    assert multihost.owner_pid("other-123-m0-hub") is None
    nets = {multihost.subnet_for(4242, s) for s in range(5)}
    assert len(nets) == 5
    for net in nets:
        a, b, c, d = net.removesuffix("/24").split(".")
        assert a == "10" and 100 <= int(b) < 228 and 0 <= int(c) < 256 and d == "0"


def test_rate_from_marks_skips_slow_start():
    marks = [(0.0, 0), (0.25, 100_000)] + [(0.5 + 0.05 * i, 200_000 + 312_500 * i) for i in range(41)]
    assert multihost.rate_from_marks(marks) == pytest.approx(50.0)  # 312.5 kB per 50 ms
    with pytest.raises(ValueError):
        multihost.rate_from_marks([(0.0, 0), (0.1, 10)])


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_topology_comes_up_reaches_every_node_holds_the_rate_and_leaves_nothing():
    _skip_unless_available()
    multihost.cleanup_stale()
    root_before = _root_links()
    with multihost.Topology(3, rate_mbit=50) as topo:
        prefix = topo.prefix
        assert sorted(_ours(prefix)) == sorted([topo.hub_name, *topo.names])
        assert len(set(topo.addresses())) == 3 and all(a.startswith(topo.subnet[:-4]) for a in topo.addresses())
        for src, dst in ((0, 1), (1, 2), (2, 0)):
            assert multihost.ping(topo, src, dst), f"node {src} does not reach node {dst}"
        # Nothing but the assigned /24 is routable from a node: nothing else can be reached.
        routes = subprocess.run(["ip", "-n", topo.namespace(0), "-4", "route", "show"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip().splitlines()
        assert len(routes) == 1 and routes[0].startswith(topo.subnet), routes
        outside = subprocess.run(topo.wrap(0, [sys.executable, "-c", "import socket; socket.create_connection("
                                               "('10.255.255.1', 9), timeout=2)"]), capture_output=True, text=True,
                                 timeout=20, check=False)
        assert outside.returncode != 0 and "unreachable" in outside.stderr, outside.stderr[-500:]
        # Both directions of every link are shaped: the node's egress and the bridge port's.
        for ns, dev in ((topo.namespace(1), multihost.NODE_IF), (topo.hub_name, topo.port(1))):
            shown = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True,
                                   timeout=10, check=True).stdout
            assert "tbf" in shown and "50Mbit" in shown, shown
        r = multihost.measure_tcp(topo, 0, 1, seconds=2.5)
        assert 0.75 * 50 <= r["rate_mbit"] <= 1.25 * 50, r
        # The links counted what crossed them: the payload and its headers, once each way.
        assert r["payload_bytes"] <= r["sent_by_src"] <= 1.15 * r["payload_bytes"], r
        assert r["payload_bytes"] <= r["received_by_dst"] <= 1.15 * r["payload_bytes"], r
        c = topo.counters()
        assert c[2].total < 0.02 * r["payload_bytes"]  # the third node saw none of it
    assert _ours(prefix) == []
    assert not any(netns.exists(n) for n in topo.names)
    assert _root_links() == root_before  # the root namespace never saw a veth end


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_everything_is_removed_after_an_error_and_stale_topologies_are_cleaned():
    _skip_unless_available()
    with pytest.raises(RuntimeError), multihost.Topology(2, rate_mbit=10, qdisc="htb") as topo:
        prefix = topo.prefix
        assert len(_ours(prefix)) == 3
        raise RuntimeError("boom")
    assert _ours(prefix) == []
    # A harness that died: its pid is gone, its namespaces stay until cleanup_stale.
    dead = subprocess.Popen(["true"])
    dead.wait(10)
    stale = [f"{multihost.PREFIX}{dead.pid}-m0-hub", f"{multihost.PREFIX}{dead.pid}-m0-0"]
    try:
        for name in stale:
            subprocess.run(["ip", "netns", "add", name], check=True, timeout=10)
        subprocess.run(["ip", "-n", stale[0], "link", "add", "v0", "type", "veth", "peer", "name", "eth0", "netns",
                        stale[1]], check=True, timeout=10)
        removed = multihost.cleanup_stale()
        assert set(stale) <= set(removed)
        assert not any(netns.exists(n) for n in stale)
    finally:
        for name in stale:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=10, check=False)


# ---- benchmarks.studies.servers_scaling: its pure parts (the real run is the benchmark itself) --------


def test_scaling_layout_and_command_lines():
    from benchmarks.studies import servers_scaling as sc

    lay = sc.layout([1, 2, 4], 8)
    assert lay.servers == {1: [0], 2: [1, 2], 4: [3, 4, 5, 6]} and lay.trainers == list(range(7, 15))
    assert lay.nodes == 15
    head = sc.server_args(0, 2, host="10.1.2.2", coordinator="10.1.2.2", update="sync", trainers=8)
    assert head[:3] == ["serve", "--host", "10.1.2.2"] and head[head.index("--sync-trainers") + 1] == "8"
    assert head[head.index("--server-rank") + 1] == "0" and "--port" in head and "--coordinator" not in head
    other = sc.server_args(1, 2, host="10.1.2.3", coordinator="10.1.2.2", port=7)
    assert other[other.index("--coordinator") + 1] == "10.1.2.2:7" and "--port" not in other
    assert "--sync-trainers" not in other and "--num-servers" not in sc.server_args(0, 1, host="h", coordinator="h")
    t = sc.trainer_args(3, 8, server="10.1.2.2", batch_size=8, steps=12, stats_out="s.json")
    assert t[t.index("--server") + 1] == "10.1.2.2:29500" and t[t.index("--step") + 1] == "pushpull"
    assert sc.server_command(head)[1:6] == ["-m", "benchmarks.harness.workers", "psserver", "--channels", "basic"]


def _leg(bw: float, per_step: float, rate: float) -> dict:
    return {"bytes_per_s": bw, "bytes_per_step": per_step, "samples_per_s": rate, "step_ms": 1000 / rate,
            "link_utilization": 0.5, "server_link_shares": None}


def test_scaling_ratios_are_taken_round_by_round_and_checked_against_the_targets():
    from benchmarks.studies import servers_scaling as sc

    runs = {1: [_leg(100, 10, 1), _leg(50, 10, 0.5), _leg(100, 10, 1)],
            2: [_leg(190, 10.2, 1.9), _leg(95, 10.1, 0.95), _leg(170, 10.0, 1.7)],
            4: [_leg(330, 10.6, 3.3), _leg(160, 10.3, 1.6), _leg(340, 10.4, 3.4)]}
    for s, shares in ((1, [1.0]), (2, [0.5, 0.5]), (4, [0.25] * 4)):
        for leg in runs[s]:
            leg["server_link_shares"] = shares
    summary = sc.summarize([1, 2, 4], runs)
    two, four = summary["setups"][2], summary["setups"][4]
    assert two["x_bytes_per_s"] == pytest.approx([1.9, 1.9, 1.7]) and two["median_x_bytes_per_s"] == pytest.approx(1.9)
    assert four["median_x_bytes_per_s"] == pytest.approx(3.3)  # per round: 3.3, 3.2, 3.4
    assert four["median_x_bytes_per_step"] == pytest.approx(1.04) and four["server_link_shares"] == [0.25] * 4
    rows = {r["name"]: r for r in sc.targets(summary)}
    assert rows["aggregate push/pull bandwidth, 2 servers / 1"]["met"] is True
    assert rows["aggregate push/pull bandwidth, 4 servers / 1"]["met"] is True
    assert rows["bytes per trainer step over all server links, 4 servers / 1"]["met"] is True
    runs[4][1]["bytes_per_s"] = 100  # one bad round moves no median below target...
    assert sc.targets(sc.summarize([1, 2, 4], runs))[2]["met"] is True
    runs[4][0]["bytes_per_s"] = 100  # ...two do
    assert sc.targets(sc.summarize([1, 2, 4], runs))[2]["met"] is False
    result = {"command": "c", "time": "t", "wall_s": 60.0, "method": "m", "error": None, "link_check": None,
              "config": {"model": "mlp_wide", "trainers": 8, "rate_mbit": 200.0}, "summary": summary,
              "targets": sc.targets(summary)}
    md = sc.markdown(result)
    assert "| 4 |" in md and "25% / 25% / 25% / 25%" in md and ">= 3.2" in md


def test_scaling_arguments():
    from benchmarks.studies import servers_scaling as sc

    quick = sc.parse_args(["--quick"])
    assert (quick.servers, quick.trainers, quick.rounds, quick.warm_up_steps) == ([1, 2], 2, 1, 0)
    full = sc.parse_args(["--servers", "4,1,2", "--timeout", "60"])
    assert (full.servers, full.trainers, full.rounds, full.update) == ([1, 2, 4], 8, 3, "sync")
    assert "--servers 1,2,4 --trainers 8" in sc.command_line(full)
    for bad in (["--servers", "0,1"], ["--steps", "5", "--skip", "3"], ["--rate", "0"], ["--servers", "x"],
                ["--timeout", "-1"]):
        with pytest.raises(SystemExit):
            sc.parse_args(bad)
