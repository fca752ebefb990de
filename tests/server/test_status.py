"""Embedding tables in the parameter server's status: the rates server 0 computes from
successive counter reads, and the way the other server processes' tables reach it."""

from __future__ import annotations

import dataclasses
import io
import pickle
import threading
from types import SimpleNamespace

import pytest

from psserver.common.torch_rpc import RestrictedUnpickler
from psserver.server.group import server_group
from psserver.server.group.partition_server import PartitionServer
from psserver.server.status import ServerView, TableRates
from psserver.telemetry import TableStatus


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(name: str = "users", rank: int = 0, lookups: int = 0, updates: int = 0) -> TableStatus:
    return TableStatus(name, rank, rows=10, max_rows=100, dim=4, bytes=1024, admissions=10, refused=1, evictions=0,
                       expirations=0, lookups=lookups, updates=updates)


def rates(out: list[TableStatus]) -> list[tuple[float, float]]:
    return [(t.lookups_per_s, t.updates_per_s) for t in out]


def test_rates_from_successive_reads():
    clock = Clock()
    r = TableRates(window=10.0, min_span=1.0, clock=clock)
    assert rates(r.observe([table(lookups=500, updates=400)])) == [(0.0, 0.0)]  # one read: no rate yet
    clock.now += 0.5
    assert rates(r.observe([table(lookups=600, updates=450)])) == [(0.0, 0.0)]  # under min_span: none yet
    clock.now += 1.5
    assert rates(r.observe([table(lookups=900, updates=600)])) == [(200.0, 100.0)]  # 400 and 200 over 2 s
    clock.now += 0.5  # read between two kept reads: the span still starts at the oldest one
    assert rates(r.observe([table(lookups=1400, updates=650)])) == [(360.0, 100.0)]  # 900 and 250 over 2.5 s
    out = r.observe([table(lookups=1400, updates=650)])[0]
    assert (out.table, out.server_rank, out.rows, out.lookups) == ("users", 0, 10, 1400)  # the rest is the read
    assert len(r._reads[(0, "users")]) == 2  # reads kept at least min_span apart


def test_rates_cover_about_the_last_window():
    clock = Clock()
    r = TableRates(window=10.0, min_span=1.0, clock=clock)
    for second in range(31):  # 100 lookups/s for 20 s, then none
        r.observe([table(lookups=100 * min(second, 20))])
        clock.now += 1.0
    clock.now -= 1.0
    assert rates(r.observe([table(lookups=2000)])) == [(0.0, 0.0)]  # idle for the last 10 s
    clock.now += 5.0
    assert rates(r.observe([table(lookups=2500)])) == [(pytest.approx(500 / 10), 0.0)]  # 500 in the last 10 s
    assert len(r._reads[(0, "users")]) <= 12  # bounded: one read per min_span over the window


def test_rates_per_table_and_server_and_restarts():
    clock = Clock()
    r = TableRates(clock=clock)
    r.observe([table("users", 0, 0), table("users", 1, 0), table("items", 0, 0)])
    clock.now += 2.0
    out = r.observe([table("users", 0, 20), table("users", 1, 40), table("items", 0, 2)])
    assert rates(out) == [(10.0, 0.0), (20.0, 0.0), (1.0, 0.0)]
    clock.now += 2.0
    # Server 1 restarted (its counters went back): no rate until two reads of the new counters.
    out = r.observe([table("users", 0, 40), table("users", 1, 5), table("items", 0, 4)])
    assert rates(out)[1] == (0.0, 0.0) and rates(out)[0] == (10.0, 0.0)
    clock.now += 1.0
    assert rates(r.observe([table("users", 1, 15)])) == [(10.0, 0.0)]
    assert set(r._reads) == {(1, "users")}  # tables no longer reported are forgotten


def test_rates_are_safe_to_read_from_several_threads():
    r = TableRates(min_span=0.0)
    errors = []

    def read(rank: int) -> None:
        try:
            for i in range(500):
                r.observe([table("users", rank, i, i), table("items", rank, i, i)])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=read, args=(rank,)) for rank in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_server_view_lists_its_own_tables_then_the_others():
    own = SimpleNamespace(status=lambda: [table("users", 0, 10), table("items", 0, 5)])
    group = SimpleNamespace(table_statuses=lambda: [table("users", 1, 7)])
    view = ServerView(config=None, engine=SimpleNamespace(tables=own), endpoint=None, policy=None,  # type: ignore[arg-type]
                      shutdown=lambda reason: None)
    view.group = group  # type: ignore[assignment]
    clock = Clock()
    view.table_rates = TableRates(clock=clock)
    assert [(t.table, t.server_rank) for t in view._tables()] == [("users", 0), ("items", 0), ("users", 1)]
    clock.now += 2.0
    own.status = lambda: [table("users", 0, 30), table("items", 0, 5)]
    assert [t.lookups_per_s for t in view._tables()] == [10.0, 0.0, 0.0]
    dense = ServerView(config=None, engine=SimpleNamespace(tables=None), endpoint=None, policy=None,  # type: ignore[arg-type]
                       shutdown=lambda reason: None)
    assert dense._tables() == []


def test_steps_read_the_tables_once_a_second():
    """A status call that comes alone has its rates: the step listener reads the tables while
    training, at most once per ``min_span``."""
    reads = []
    own = SimpleNamespace(status=lambda: reads.append(1) or [table("users", 0, 100 * len(reads))])
    endpoint = SimpleNamespace(membership=None)
    view = ServerView(config=None, engine=SimpleNamespace(tables=own), endpoint=endpoint, policy=None,  # type: ignore[arg-type]
                      shutdown=lambda reason: None)
    clock = Clock()
    view.table_rates = TableRates(clock=clock)
    for _ in range(3):
        view.on_step(1, 64)
    assert len(reads) == 1
    clock.now += 2.0
    view.on_step(2, 64)
    assert len(reads) == 2 and view.table_rates.due() is False
    clock.now += 0.5
    assert [t.lookups_per_s for t in view._tables()] == [200 / 2.5]  # the first read is 2.5 s old
    dense = ServerView(config=None, engine=SimpleNamespace(tables=None), endpoint=endpoint, policy=None,  # type: ignore[arg-type]
                       shutdown=lambda reason: None)
    dense.on_step(1, 64)  # a dense model reads nothing


def test_a_peers_tables_cross_rpc_as_plain_types():
    tables = SimpleNamespace(status=lambda: [table("users", 1, 70, 60), table("items", 1, 3, 2)])
    engine = SimpleNamespace(global_step=9, shards=[SimpleNamespace(num_bytes=400)], tables=tables)
    reply = PartitionServer.status(SimpleNamespace(engine=engine))  # type: ignore[arg-type]
    # What server 0's RPC layer unpickles: no global may be needed to read it.
    wire = RestrictedUnpickler(io.BytesIO(pickle.dumps(reply))).load()
    assert wire["updates"] == 9 and wire["bytes"] == 400
    assert server_group._tables(wire) == tables.status()
    dense = SimpleNamespace(global_step=1, shards=[], tables=None)
    assert PartitionServer.status(SimpleNamespace(engine=dense))["tables"] == []  # type: ignore[arg-type]


def test_server_0_reads_what_peers_of_other_versions_reply():
    assert server_group._tables({"updates": 1, "bytes": 2}) == []  # a peer without tables in its reply
    newer = dataclasses.asdict(table("users", 2, 5)) | {"a_later_field": 1}
    assert server_group._tables({"tables": [newer]}) == [table("users", 2, 5)]


def test_group_lists_the_tables_peers_last_reported():
    group = server_group.ServerGroup.__new__(server_group.ServerGroup)
    group.peers = {2: server_group.Peer(2, "ps_2"), 1: server_group.Peer(1, "ps_1")}
    assert group.table_statuses() == []
    group.peers[2].tables = [table("users", 2)]
    group.peers[1].tables = [table("users", 1), table("items", 1)]
    assert [(t.table, t.server_rank) for t in group.table_statuses()] == [("users", 1), ("items", 1), ("users", 2)]


def test_a_shard_shows_its_parameters_and_optimizer_state_not_the_process_memory():
    """A CPU shard of a small model, after Adam steps: the status, its JSON, the table and the
    Prometheus gauge all give the shard's own bytes (parameters + two moments + step counts),
    not the process's resident memory (hundreds of MB of torch)."""
    import torch

    from psserver.config import OptimizerConfig, ServerConfig
    from psserver.control import convert, render
    from psserver.exporters import StatusCollector
    from psserver.server.server import ParameterServer
    from psserver.utils.units import human_bytes

    server = ParameterServer(ServerConfig(model="mlp", devices=["cpu"], optimizer=OptimizerConfig("adam", 1e-3)))
    try:
        engine = server.engine
        shard = engine.shards[0]
        assert server.view.get_status().shards[0].state_bytes == shard.num_bytes  # no optimizer state yet
        engine.trainer_joined("t")
        for _ in range(2):
            engine.open_step("t", 4)
            engine.submit("t", {p: torch.ones_like(p) for p in engine.trainable})
        status = server.view.get_status()
    finally:
        engine.close()
    (s,) = status.shards
    tensors = len(shard.params)
    assert s.bytes == shard.num_bytes and 3 * s.bytes < s.state_bytes <= 3 * s.bytes + 8 * tensors < 8 << 20
    msg = convert.status_to_proto(status)
    assert convert.status_to_dict(msg)["shards"][0]["state_bytes"] == s.state_bytes
    lines = render.render_status(msg, None, address="x:1").splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("SHARD"))
    assert lines[head].split()[-2:] == ["WITH", "OPTIMIZER"]
    assert lines[head + 1].endswith(human_bytes(s.state_bytes))
    gauges = {(m.name, tuple(sample.labels.items())): sample.value
              for m in StatusCollector(server.view).collect() for sample in m.samples}
    assert gauges[("psserver_shard_state_bytes", (("shard", "0"), ("device", "cpu")))] == s.state_bytes
