"""Several server processes past one machine, on this one machine: every server process and every trainer in
a network namespace of its own, behind a veth link limited with ``tc`` (``benchmarks.harness.multihost``),
a bandwidth-bound job (``mlp_wide``: 1.9M parameters, little compute; trainer compute, each step
~7.5 MB up and ~7.5 MB down), run with 1 server and then with 2: the median step time with 2
servers is at most 0.6x that with 1.

The servers run ``--update sync``: every trainer pushes at once and pulls at once, so a step's
time is the bytes over the busiest link over its rate (1 server: 2 trainers x 7.5 MB each way
over its link; 2 servers: half of that on each), whatever the trainers' phases. With async the
phases drift (a server link carries both directions at once while one trainer pushes and the
other pulls, one direction when they move in step): four async runs here (2 and 4 trainers)
gave ratios of 0.47, 0.63, 0.65 and 0.67.

Traffic goes only to the 10.x addresses the test's own topology assigned; the namespaces and
links are removed at the end, the processes killed first (skipped, with the reason, where the
namespaces cannot be made: not root, no ``ip``/``tc``)."""

from __future__ import annotations

import json
import sys
import time

import pytest

from benchmarks.harness import multihost, paired
from benchmarks.studies.servers_scaling import (
    ONE_THREAD,
    READY_OTHER,
    READY_RANK0,
    SERVER_WRAPPER,
    server_args,
    trainer_args,
)

RATE_MBIT = 100
"""Each link, each way: a 1-server step of 2 trainers moves 15 MB up and then 15 MB down over
the server's link (2.4 s), far above the steps' compute (tens of ms), yet 10 steps of both
setups fit in the budget (about 55 s in all on an idle 2-core machine)."""
TRAINERS = 2
UPDATE = "sync"
STEPS, SKIP = 10, 3
BATCH = 8
BUDGET_S = 120.0
MLP_WIDE_PARAMETERS = 784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10


def _run_job(procs, topo: multihost.Topology, server_nodes: list[int], trainer_nodes: list[int], tmp_path, tag: str,
             deadline: float) -> dict:
    """Start the servers, then the trainers for STEPS steps: the median step time (in the
    interval in which all trainers step, after SKIP steps each), the bytes per trainer step over
    the servers' links and each server link's share of them. Every server is killed before
    returning."""
    head = topo.address(server_nodes[0])
    s = len(server_nodes)
    servers = []
    try:
        for rank, node in enumerate(server_nodes):
            args = server_args(rank, s, host=topo.address(node), coordinator=head, update=UPDATE,
                               trainers=len(trainer_nodes))
            servers.append(procs.start(args, f"{tag}-server{rank}", env=ONE_THREAD,
                                       prefix=topo.wrap(node, [sys.executable, *SERVER_WRAPPER])))
            servers[-1].wait_for(READY_RANK0 if rank == 0 else READY_OTHER, timeout=max(5, deadline - time.monotonic()))
        before = topo.counters()
        stats = [tmp_path / f"{tag}-trainer{r}.json" for r in range(len(trainer_nodes))]
        trainers = [procs.start(trainer_args(r, len(trainer_nodes), server=head, batch_size=BATCH, steps=STEPS,
                                             stats_out=stats[r]), f"{tag}-trainer{r}", env=ONE_THREAD,
                                prefix=topo.wrap(node, [sys.executable, "-m", "psserver"]))
                    for r, node in enumerate(trainer_nodes)]
        for t in trainers:
            code = t.wait(max(5, deadline - time.monotonic()))
            assert code == 0, f"{t.name} exited with {code}:\n{t.tail()}\n{servers[0].tail()}"
        after = topo.counters()
        moved = [after[k].total - before[k].total for k in server_nodes]
    finally:
        for p in servers:
            p.kill()
    ends = [json.loads(f.read_text())["step_ends"] for f in stats]
    leg = paired.leg_rate(ends, BATCH, SKIP)  # the interval in which both trainers step, after SKIP steps each
    steps = sum(len(e) for e in ends)
    return {"step_ms": leg["step_ms"], "bytes_per_step": sum(moved) / steps, "steps": steps,
            "step_ms_per_trainer": leg["step_ms_per_process"],
            "server_link_shares": [round(b / sum(moved), 3) for b in moved]}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.alone
@pytest.mark.timeout(180)
def test_two_servers_cut_the_step_time_of_a_bandwidth_bound_job_across_namespaces(procs, tmp_path):
    reason = multihost.available()
    if reason:
        pytest.skip(f"cannot create network namespaces with rate-limited veth links here: {reason}")
    multihost.cleanup_stale()
    deadline = time.monotonic() + BUDGET_S
    # Nodes 0 and 1: servers; 2 and 3: trainers. Every link 100 Mbit/s each way.
    with multihost.Topology(2 + TRAINERS, RATE_MBIT) as topo:
        try:
            trainers = list(range(2, 2 + TRAINERS))
            one = _run_job(procs, topo, [0], trainers, tmp_path, "one", deadline)
            two = _run_job(procs, topo, [0, 1], trainers, tmp_path, "two", deadline)
        finally:
            procs.kill_all()  # before the namespaces go
    # The tensors crossed the links (TensorPipe's basic channel), not shared memory: every
    # trainer step moved at least its gradient up and the parameters down over the server links.
    floor = 2 * 4 * MLP_WIDE_PARAMETERS
    for run in (one, two):
        assert run["bytes_per_step"] >= 0.95 * floor, (one, two)
    ratio = two["step_ms"] / one["step_ms"]
    print(f"median step: 1 server {one['step_ms']:.0f} ms, 2 servers {two['step_ms']:.0f} ms, ratio {ratio:.2f}; "
          f"bytes per trainer step over the server links {one['bytes_per_step'] / 1e6:.2f} MB / "
          f"{two['bytes_per_step'] / 1e6:.2f} MB; the 2 server links' shares of the bytes {two['server_link_shares']}")
    assert ratio <= 0.6, (one, two)
