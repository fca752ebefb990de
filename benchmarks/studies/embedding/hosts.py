"""Embedding tables benchmark: the hosts its processes run on.

``Hosts`` builds one ``benchmarks.harness.multihost`` topology (a network namespace and a tc-limited veth
link per node) and starts and stops the processes on it: the server groups, server 0's status
poller (``_POLLER``) and the trainers, gated to start stepping together (``_GATE``). Kept apart
from ``benchmarks.studies.embedding.tables`` (what runs in which order, and the command line); of the
other ``embedding_*`` modules it imports only ``embedding_measure`` (to parse the poller's lines)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import measure, multihost
from benchmarks.studies import servers_scaling as scaling
from benchmarks.studies.embedding.measure import poll_lines

CONTROL_PORT = 50051
"""Server 0's control plane, on the loopback of its own namespace (nothing else reaches it)."""
GATE_TIMEOUT_S = 180.0
"""How long trainers wait for each other at their first step."""


_POLLER = r"""
import json, sys, time
from psserver.control.client import ControlClient
from psserver.control.convert import status_to_dict
address, interval, seconds = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
end = time.monotonic() + seconds
with ControlClient(address, timeout=5) as client:
    while True:
        t0 = time.monotonic()
        try:
            s = status_to_dict(client.get_status())
        except Exception as e:  # a late or refused read is a gap, not the end
            print(json.dumps({"error": str(e).splitlines()[0] if str(e) else type(e).__name__}), flush=True)
        else:
            t1 = time.monotonic()
            print(json.dumps({"t": (t0 + t1) / 2, "tables": s["tables"], "servers": s["servers"]}), flush=True)
        if time.monotonic() >= end:
            break
        time.sleep(max(0.0, interval - (time.monotonic() - t0)))
"""
"""Runs in server 0's namespace: one JSON line per status read, ``t`` its monotonic time."""

_GATE = r"""
import os, sys, time
ready, go, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])
from psserver.trainer.steps import trainer_compute
first = trainer_compute.TrainerComputeHalf.step
def gated(self, x, y):
    trainer_compute.TrainerComputeHalf.step = first
    open(ready, "w").close()
    end = time.monotonic() + timeout
    while not os.path.exists(go) and time.monotonic() < end:
        time.sleep(0.005)
    return first(self, x, y)
trainer_compute.TrainerComputeHalf.step = gated
from psserver.cli import main
sys.exit(main(sys.argv[4:]))
"""
"""``psserver train ARGS`` whose first step waits (joined, its data loaded, heartbeats going) until
the harness creates ``go``, once every trainer has created its ``ready``: all start stepping
together. Eight trainers starting on two cores otherwise start seconds apart, and the first
ones, alone on the links, may be nearly done before the last one's first step (no common window)."""


# ---- running -------------------------------------------------------------------------------------


class Hosts:
    """One topology and the processes on it (``close`` stops every process, then removes the
    namespaces)."""

    def __init__(self, nodes: int, rate_mbit: float, work: Path, deadline: scaling.Deadline, *,
                 packets: str = "gso", qdisc: str = "tbf") -> None:
        self.work, self.deadline = work, deadline
        self.children = measure.Children(work)
        multihost.cleanup_stale()
        self.topo = multihost.Topology(nodes, rate_mbit, qdisc=qdisc)
        try:
            if packets == "mtu":
                for k in range(nodes):  # the senders: every TCP segment its own frame
                    subprocess.run(["ip", "-n", self.topo.namespace(k), "link", "set", "dev", multihost.NODE_IF,
                                    "gso_max_segs", "1"], capture_output=True, text=True, timeout=30, check=True)
        except BaseException:
            self.topo.close()
            raise

    def close(self) -> None:
        try:
            self.children.stop_all()
        finally:
            self.topo.close()

    def start(self, node: int, argv: list[str], name: str) -> measure.Child:
        return self.children.start(self.topo.wrap(node, argv), name, scaling.ONE_THREAD)

    def start_group(self, nodes: list[int], argv_of, tag: str, ready_s: float = 180) -> list[measure.Child]:
        """Server processes on ``nodes`` (``argv_of(rank, host, coordinator)``), ready when returned;
        server 0 first, then the others together."""
        head = self.topo.address(nodes[0])
        procs = [self.start(nodes[0], scaling.server_command(argv_of(0, head, head)), f"{tag}-server0")]
        procs[0].wait_for(scaling.READY_RANK0, self.deadline.left(ready_s))
        for rank, node in enumerate(nodes[1:], start=1):
            procs.append(self.start(node, scaling.server_command(argv_of(rank, self.topo.address(node), head)),
                                    f"{tag}-server{rank}"))
        for p in procs[1:]:
            p.wait_for(scaling.READY_OTHER, self.deadline.left(ready_s))
        return procs

    def poller(self, node: int, name: str, seconds: float, interval: float = 0.5) -> measure.Child:
        """Reads server 0's status (on ``node``) every ``interval`` s for ``seconds``."""
        argv = [sys.executable, "-c", _POLLER, f"127.0.0.1:{CONTROL_PORT}", str(interval), str(seconds)]
        return self.start(node, argv, name)

    def status_once(self, node: int, name: str) -> dict | None:
        p = self.poller(node, name, 0.0)
        p.wait(self.deadline.left(60))
        lines = poll_lines(p.output())
        self.children.items.remove(p)
        p.stop()
        return lines[-1] if lines else None

    def run_trainers(self, tag: str, jobs: list[tuple[int, list[str]]], servers: list[measure.Child]) -> None:
        """Trainers ``(node, argv)``, started together at their first step (``_GATE``), until every
        one has exited 0 (``RuntimeError`` otherwise)."""
        for p in servers:
            if not p.running():
                raise RuntimeError(f"{p.name} exited:\n{p.tail()}")
        go = self.work / f"{tag}.go"
        ready = [self.work / f"{tag}-trainer{r}.ready" for r in range(len(jobs))]
        procs = [self.start(node, [sys.executable, "-c", _GATE, str(ready[r]), str(go), str(GATE_TIMEOUT_S), *argv],
                            f"{tag}-trainer{r}") for r, (node, argv) in enumerate(jobs)]
        try:
            limit = time.monotonic() + GATE_TIMEOUT_S
            while not all(f.exists() for f in ready):
                for p in procs:
                    if not p.running():
                        raise RuntimeError(f"{p.name} exited with {p.wait(5)} before its first step:\n{p.tail()}")
                if time.monotonic() > limit:
                    raise RuntimeError(f"the trainers of {tag} were not all at their first step within "
                                       f"{GATE_TIMEOUT_S:.0f} s")
                self.deadline.left()
                time.sleep(0.02)
            go.touch()
            scaling.wait_all(procs, self.deadline)
        finally:
            for p in procs:
                p.stop()
            self.children.items = [c for c in self.children.items if c not in procs]
