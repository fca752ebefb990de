"""Embedding tables on the parameter servers: their bytes per step and their rows per second.

    python -m benchmarks.embedding_tables --quick --results-dir /tmp/tables                  # ~45 s
    timeout 14m python -m benchmarks.embedding_tables --timeout 780                         # ~7 min
    python -m benchmarks.embedding_tables --skip-rates                                      # (A) only

Two measurements (issue 19), each on hosts of its own (``benchmarks.multihost``: every server
process and every trainer in a network namespace behind a ``tc``-limited veth link to one bridge;
servers with TensorPipe's ``basic`` channel, as in ``benchmarks.servers_scaling``):

(A) **Bytes per trainer step against the ideal, with 10^4 and with 10^7 rows per table.** ``mf``
on MovieLens-100k (tables ``user`` and ``item``, rows of ``--embedding-dim`` 8 + 1 bias column; the
dense part is one float, the global mean), one server process per prefill (``--embedding-prefill``
10^4 and 10^7 rows per table; both stay up for the whole measurement), ``--bytes-trainers``
trainers. The ideal of a step is what its tables' traffic needs at least: each unique id of the
batch once (8 bytes), its row down and its gradient up (row width x 4 bytes each). The trainers
count it (``row_payload_bytes`` of ``--stats-out``) only for a whole run, so the benchmark
computes it for every step from the same data, sampler, seed and batch size (each trainer's
batches are those of ``DistributedSampler``), checks that the sum over the run equals what the
trainer counted, and sums it over the steps that end inside the measured window. The bytes are
those over the server's link in the same window (both directions, Ethernet/IP/TCP headers
included: the bridge ports' counters, read every 0.1 s); the window is the interval in which
every trainer steps, after ``--bytes-skip`` steps of each, from the first to the last reading
inside it. The ratio bytes / ideal is taken per run; the runs of the two prefills (and of a
smaller batch, ``--small-batch``) alternate in paired rounds, and the ratio 10^7 / 10^4 is taken
round by round; the medians over rounds are reported. Packets are counted too: 66 bytes of
headers each (Ethernet 14, IPv4 20, TCP 20 + 12 of timestamps), which splits the overhead into
headers and TCP payload beyond the ideal (RPC framing, pickled arguments, the dense part,
heartbeats). ``--packets mtu`` (default) sets ``gso_max_segs 1`` on every node's interface: each
TCP segment crosses as a frame of at most 1514 bytes with its own headers, as a NIC with TSO puts
it on the wire and counts it; ``--packets gso`` keeps veth's default, where one counted packet may
carry up to 64 KB behind one set of headers (issue 18's counters).

(B) **Row lookups and updates per second per server process, 1, 2 and 4 of them.** ``dlrm_tiny``
on ``synthetic_clicks`` (4 tables of ``--embedding-dim`` 16), ``--trainers`` trainers, every link
``--rate`` Mbit/s each way. Every server group stays up for the whole run (one unmeasured warm-up
run each); each round runs every group once, in an order that rotates. Server 0 of each group
serves the control plane on its own namespace's loopback, and a poller there reads its status
every 0.5 s (``tables``: one entry per table per server process, cumulative ``lookups`` and
``updates``; server 0 has the others' counters as of its last watch of them, every second, and
says how old they are). A server's lookups/s and updates/s are the deltas of its counters between
its first and last readings inside the run's window (as in (A)) over the time between them;
the totals are their sums, divided by the 1-server run's of the same round (medians over rounds).
Each server process's CPU time over the window (``/proc/PID/stat``) gives the lookups per
CPU-second, what one server process would do on a core of its own. The default rate (25 Mbit/s)
makes one server's link, not the machine's cores, bound the 1-server run; the machine's busy
fraction (``/proc/stat``) over the window shows where the cores bound the others.

Trainers and servers run one torch thread (``OMP_NUM_THREADS=1``, ``--compute-threads 1``),
``--step pushpull``, ``--update async``. Results: ``--results-dir`` (default
``benchmarks/results/issue19/``), ``embedding-tables.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import measure, multihost, paired, report
from benchmarks import servers_scaling as scaling

log = logging.getLogger(__name__)

DEFAULT_RESULTS = Path(__file__).resolve().parent / "results" / "issue19"
BYTES_TARGET = 1.1
"""(A): bytes over the network per trainer step <= 1.1 x the ideal."""
SAME_TOLERANCE = 0.02
"""(A): "the same at 10^4 and 10^7 rows": the ratio between them within 1 +- 0.02 (ours)."""
HEADER_BYTES = 66
"""Ethernet (14) + IPv4 (20) + TCP (20) + TCP timestamps (12) per packet."""
CONTROL_PORT = 50051
"""Server 0's control plane, on the loopback of its own namespace (nothing else reaches it)."""
WIRE_BYTES = 4
"""fp32 rows and row gradients (``--wire-dtype fp32``, the trainers' default)."""
GATE_TIMEOUT_S = 180.0
"""How long trainers wait for each other at their first step."""
MAX_ROWS_SLACK = 1_000_000
"""Rows a table may hold beyond its prefill: nothing is evicted while the runs create rows."""

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
from psserver.ps.protocols import trainer_compute
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


# ---- command lines ---------------------------------------------------------------------------


def server_args(rank: int, num_servers: int, *, host: str, coordinator: str, model: str, dim: int, prefill: int = 0,
                max_rows: int | None = None) -> list[str]:
    """``psserver serve`` arguments (``servers_scaling.server_args``, async) with the tables'
    flags; server 0 serves the control plane on its namespace's loopback."""
    args = scaling.server_args(rank, num_servers, host=host, coordinator=coordinator, model=model)
    if rank == 0:
        args.remove("--no-control")
        args += ["--control-port", str(CONTROL_PORT)]
    args += ["--embedding-dim", str(dim), "--embedding-max-rows", str(max_rows or prefill + MAX_ROWS_SLACK)]
    if prefill:
        args += ["--embedding-prefill", str(prefill)]
    return args


def trainer_args(rank: int, trainers: int, *, server: str, batch_size: int, steps: int, dataset: str,
                 stats_out: str | Path, extra: tuple[str, ...] = ()) -> list[str]:
    """``psserver train`` arguments: ``--step pushpull``, one torch thread, ``steps`` steps,
    each step's end and the tables' ideal bytes written to ``stats_out``."""
    return ["train", "--server", f"{server}:{scaling.SERVER_PORT}", "--rank", str(rank), "--num-trainers",
            str(trainers), "--epochs", "1000000", "--batch-size", str(batch_size), "--max-steps", str(steps),
            "--dataset", dataset, "--no-progress", "--step", "pushpull", "--compute-threads", "1", "--stats-out",
            str(stats_out), *extra]


# ---- counters --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Count:
    """What one node received and sent over its link so far: bytes (headers included) and packets."""

    rx_bytes: int
    rx_packets: int
    tx_bytes: int
    tx_packets: int

    @property
    def bytes(self) -> int:
        return self.rx_bytes + self.tx_bytes

    @property
    def packets(self) -> int:
        return self.rx_packets + self.tx_packets


def parse_ports(text: str) -> dict[str, tuple[int, int, int, int]]:
    """(received bytes, received packets, transmitted bytes, transmitted packets) of every
    interface in ``/proc/net/dev`` text."""
    out = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        f = rest.split()
        if sep and len(f) >= 10:
            out[name.strip()] = (int(f[0]), int(f[1]), int(f[8]), int(f[9]))
    return out


def link_counts(topo: multihost.Topology) -> dict[int, Count]:
    """Every node's ``Count`` from its own side: the bridge port's transmitted bytes are what the
    node received (as ``Topology.counters``, with packets)."""
    if topo.hub is None or topo.hub.anchor is None or topo.hub.anchor.poll() is not None:
        raise OSError(f"the anchor process of {topo.hub_name} is gone")
    ports = parse_ports(Path(f"/proc/{topo.hub.anchor.pid}/net/dev").read_text())
    out = {}
    for k in range(len(topo)):
        rxb, rxp, txb, txp = ports[topo.port(k)]
        out[k] = Count(rx_bytes=txb, rx_packets=txp, tx_bytes=rxb, tx_packets=rxp)
    return out


def machine_jiffies() -> tuple[int, int]:
    """(all, idle + iowait) jiffies of the machine so far (``/proc/stat``)."""
    v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(v[:8]), v[3] + v[4]


@dataclass(frozen=True)
class Reading:
    t: float
    links: dict[int, Count]
    cpu: dict[int, float | None]
    """CPU seconds so far of each tracked pid (None: gone)."""
    machine: tuple[int, int]


class Sampler:
    """Reads the links' counters, the CPU time of some processes and the machine's every
    ``interval`` seconds from a thread (a first reading at once, a last one at ``stop``)."""

    def __init__(self, topo: multihost.Topology, pids: list[int], interval: float = 0.1) -> None:
        self.topo, self.pids, self.interval = topo, pids, interval
        self.readings: list[Reading] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tables-sampler", daemon=True)

    def read(self) -> Reading:
        return Reading(time.monotonic(), link_counts(self.topo), {p: measure.proc_cpu_seconds(p) for p in self.pids},
                       machine_jiffies())

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.readings.append(self.read())
            except OSError as e:
                log.warning("reading the counters failed: %s", e)
            self._stop.wait(self.interval)

    def start(self) -> Sampler:
        self.readings.append(self.read())
        self._thread.start()
        return self

    def stop(self) -> list[Reading]:
        self._stop.set()
        self._thread.join(10)
        self.readings.append(self.read())
        return self.readings


def inside(readings: list, t0: float, t1: float) -> tuple | None:
    """The first and last of ``readings`` (each with ``.t`` or ``[0]``) inside [t0, t1]."""
    def t(r) -> float:
        return r.t if hasattr(r, "t") else r[0]

    got = [r for r in readings if t0 <= t(r) <= t1]
    if len(got) < 2 or t(got[-1]) <= t(got[0]):
        return None
    return got[0], got[-1]


# ---- (A): the ideal bytes of every step -------------------------------------------------------


def step_ideals(ids, *, rank: int, trainers: int, batch_size: int, steps: int, columns: list[tuple[int, int]],
                seed: int = 0, wire_bytes: int = WIRE_BYTES) -> list[tuple[int, int]]:
    """(up, down) ideal bytes of each of a trainer's ``steps`` steps: up, each unique id of every
    table (8 bytes) and its row gradient; down, its row (``columns``: (id column, row width) of
    each table). The batches are the trainer's: ``DistributedSampler(shuffle=True, seed)`` over
    the training set, ``set_epoch`` per epoch, consecutive slices of ``batch_size``
    (``psserver.ps.trainer``); ``ids`` is the training set's id tensor."""
    import torch
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(ids.shape[0]), num_replicas=trainers, rank=rank, shuffle=True, seed=seed,
                                 drop_last=False)
    per_epoch = (len(sampler) + batch_size - 1) // batch_size
    out: list[tuple[int, int]] = []
    epoch = 0
    while len(out) < steps:
        sampler.set_epoch(epoch)
        order = torch.tensor(list(iter(sampler)))
        for b in range(per_epoch):
            if len(out) >= steps:
                break
            batch = ids[order[b * batch_size:(b + 1) * batch_size]]
            unique = [(torch.unique(batch[:, col]).numel(), width) for col, width in columns]
            rows = sum(n * width for n, width in unique) * wire_bytes
            out.append((8 * sum(n for n, _ in unique) + rows, rows))
        epoch += 1
    return out


def movielens_ids():
    """The id tensor of MovieLens-100k's training split, as every trainer loads it."""
    from psserver.config import DataConfig
    from psserver.data import load_dataset
    from psserver.models import get_model_spec

    spec = get_model_spec("mf")
    train, _ = load_dataset(DataConfig(dataset="movielens100k"), spec.input_shape, spec.num_classes,
                            spec.input_dtype)
    return train.tensors[0]


def mf_columns(dim: int) -> list[tuple[int, int]]:
    from psserver.models import get_model_spec

    return [(d.column, dim + d.extra_dims) for d in get_model_spec("mf").tables]


def rpc_pickle_sizes(dim: int) -> dict:
    """Bytes of the pickled parts of one ``exchange`` of ``mf`` (torch's RPC pickler, as the
    trainer's ``rpc_sync`` makes them; tensors travel beside, so their sizes do not matter):
    the call up (function, trainer name, op, arguments, the progress ``Report`` every call
    carries) and the reply down. What else a step sends beyond the ideal is torch RPC's and
    TensorPipe's framing of the two messages and their tensors, and the headers."""
    import torch
    from torch.distributed.rpc.internal import PythonUDF, _internal_rpc_pickler

    from psserver.models import get_model_spec
    from psserver.ps import endpoint
    from psserver.ps.messages import Report

    names = [d.name for d in get_model_spec("mf").tables]
    rows = {"grads": {n: torch.zeros(10, dim + 1) for n in names},
            "ids": {n: torch.zeros(10, dtype=torch.int64) for n in names}}
    report = Report(steps=1234, samples=1_263_616, loss=0.8813, samples_per_s=106_496.2)
    call = ("trainer_0_1", "exchange", ([torch.zeros(1)], 1024, None, rows))
    up, up_tensors = _internal_rpc_pickler.serialize(PythonUDF(endpoint.call, (*call, report), {}))
    bare, _ = _internal_rpc_pickler.serialize(PythonUDF(endpoint.call, (*call, None), {}))
    down, down_tensors = _internal_rpc_pickler.serialize((([torch.zeros(1)], {n: torch.zeros(10, dim + 1)
                                                                               for n in names}), []))
    return {"request": len(up), "report": len(up) - len(bare), "reply": len(down),
            "request_tensors": len(up_tensors), "reply_tensors": len(down_tensors)}


# ---- (A): one run's analysis --------------------------------------------------------------------


def bytes_window(readings: list[Reading], node: int, ends: list[list[float]], ideals: list[list[tuple[int, int]]],
                 batch_size: int, skip: int) -> dict:
    """Bytes over ``node``'s link against the ideal of the steps that end between the first and
    last readings inside the run's window (``paired.leg_rate``: every trainer steps, ``skip``
    steps each left out). ``ideals``: (up, down) of each trainer's steps, in order."""
    leg = paired.leg_rate(ends, batch_size, skip)
    pair = inside(readings, leg["start"], leg["end"])
    if pair is None:
        raise RuntimeError("fewer than two counter readings inside the run's window (raise --bytes-steps)")
    a, b = pair
    up = down = steps = 0
    for e, ideal in zip(ends, ideals, strict=True):
        for t, (u, d) in zip(e, ideal, strict=True):
            if a.t < t <= b.t:
                up, down, steps = up + u, down + d, steps + 1
    ca, cb = a.links[node], b.links[node]
    received, sent = cb.rx_bytes - ca.rx_bytes, cb.tx_bytes - ca.tx_bytes  # the server's
    packets = cb.packets - ca.packets
    up_packets, down_packets = cb.rx_packets - ca.rx_packets, cb.tx_packets - ca.tx_packets
    total, ideal = received + sent, up + down
    headers = HEADER_BYTES * packets
    leg.update({
        "window_s": b.t - a.t, "window_steps": steps, "bytes": total, "ideal_bytes": ideal,
        "ratio": total / ideal if ideal else None,
        "bytes_per_step": total / steps if steps else None, "ideal_per_step": ideal / steps if steps else None,
        "up_bytes": received, "ideal_up": up, "down_bytes": sent, "ideal_down": down,
        "ratio_up": received / up if up else None, "ratio_down": sent / down if down else None,
        "packets_per_step": packets / steps if steps else None,
        "header_share": headers / ideal if ideal else None,
        "payload_overhead_per_step": (total - headers - ideal) / steps if steps else None,
        "payload_share": (total - headers - ideal) / ideal if ideal else None,
        "up_packets_per_step": up_packets / steps if steps else None,
        "down_packets_per_step": down_packets / steps if steps else None,
        "payload_overhead_up_per_step": (received - HEADER_BYTES * up_packets - up) / steps if steps else None,
        "payload_overhead_down_per_step": (sent - HEADER_BYTES * down_packets - down) / steps if steps else None,
    })
    return leg


# ---- (B): status readings -------------------------------------------------------------------------


def poll_lines(text: str) -> list[dict]:
    """The status reads of a poller's output (its JSON lines with a time)."""
    out = []
    for line in text.splitlines():
        if line.startswith('{"t"'):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line cut short by the poller's end
    return out


def status_series(lines: list[dict]) -> dict[int, list[tuple[float, int, int, int]]]:
    """Per server rank, (time of the counters, lookups, updates, rows) summed over its tables.
    Server 0's own are read at the poll; the others' as of server 0's last watch of them, whose
    age the status gives (``last_seen_age_seconds``); a repeat of the same watch is dropped."""
    series: dict[int, list[tuple[float, int, int, int]]] = {}
    for line in lines:
        ages = {s["rank"]: s.get("last_seen_age_seconds") for s in line.get("servers", [])}
        sums: dict[int, list[int]] = {}
        for tab in line.get("tables", []):
            acc = sums.setdefault(int(tab["server_rank"]), [0, 0, 0])
            acc[0] += int(tab["lookups"])
            acc[1] += int(tab["updates"])
            acc[2] += int(tab["rows"])
        for rank, (lookups, updates, rows) in sums.items():
            age = 0.0 if rank == 0 else ages.get(rank)
            if age is None:
                continue
            t = line["t"] - age
            got = series.setdefault(rank, [])
            if got and abs(got[-1][0] - t) < 0.2 and got[-1][1:3] == (lookups, updates):
                continue
            got.append((t, lookups, updates, rows))
    for got in series.values():
        got.sort()
    return series


def rates_window(readings: list[Reading], lines: list[dict], ends: list[list[float]], *, servers: int,
                 server_nodes: list[int], server_pids: list[int], batch_size: int, skip: int,
                 rate_mbit: float) -> dict:
    """Lookups and updates per second of every server process (counter deltas between its first
    and last readings inside the run's window over the time between them), their totals, each
    server's CPU, the machine's busy fraction and the server links' bytes in the same window."""
    leg = paired.leg_rate(ends, batch_size, skip)
    t0, t1 = leg["start"], leg["end"]
    series = status_series(lines)
    lookups, updates, rows = [], [], []
    for rank in range(servers):
        pair = inside(series.get(rank, []), t0, t1)
        if pair is None:
            lookups.append(None)
            updates.append(None)
            rows.append(series[rank][-1][3] if series.get(rank) else None)
            continue
        (ta, la, ua, _), (tb, lb, ub, rb) = pair
        lookups.append((lb - la) / (tb - ta))
        updates.append((ub - ua) / (tb - ta))
        rows.append(rb)
    leg.update({"lookups_per_s": lookups, "updates_per_s": updates, "rows": rows,
                "total_lookups_per_s": sum(lookups) if None not in lookups else None,
                "total_updates_per_s": sum(updates) if None not in updates else None,
                "status_reads": {r: len(s) for r, s in series.items()}})
    pair = inside(readings, t0, t1)
    if pair is not None:
        a, b = pair
        dt = b.t - a.t
        cores = [None if a.cpu.get(p) is None or b.cpu.get(p) is None else (b.cpu[p] - a.cpu[p]) / dt
                 for p in server_pids]
        moved = sum(b.links[k].bytes - a.links[k].bytes for k in server_nodes)
        steps = sum(1 for e in ends for t in e if a.t < t <= b.t)
        total_all, idle = b.machine[0] - a.machine[0], b.machine[1] - a.machine[1]
        leg.update({
            "server_cores": cores,
            "lookups_per_cpu_s": [None if c is None or not c or lk is None else lk / c
                                  for lk, c in zip(lookups, cores, strict=True)],
            "server_ms_per_step": [None if c is None or not steps else 1e3 * c * dt / steps for c in cores],
            "machine_busy": 1 - idle / total_all if total_all else None,
            "bytes_per_s": moved / dt, "bytes_per_step": moved / steps if steps else None,
            "link_utilization": moved / dt / (servers * 2 * rate_mbit * 1e6 / 8),
        })
    return leg


# ---- summaries and targets -----------------------------------------------------------------------


def _median(values: list) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def summarize_bytes(setups: list[dict], runs: dict[str, list[dict]]) -> dict:
    """Per setup the medians over rounds; the ratio of each setup's bytes/ideal to the first
    setup's (10^4 rows) of the same round."""
    base = setups[0]["name"]
    out: dict = {"baseline": base, "setups": {}}
    for s in setups:
        legs = runs.get(s["name"], [])
        row: dict = {**s, "rounds": len(legs)}
        for key in ("ratio", "ratio_up", "ratio_down", "bytes_per_step", "ideal_per_step", "packets_per_step",
                    "header_share", "payload_share", "payload_overhead_per_step", "samples_per_s",
                    "whole_run_ratio", "up_packets_per_step", "down_packets_per_step", "payload_overhead_up_per_step",
                    "payload_overhead_down_per_step"):
            row[key] = [leg.get(key) for leg in legs]
            row[f"median_{key}"] = _median(row[key])
        row["x_baseline"] = [None if a.get("ratio") is None or not b.get("ratio") else a["ratio"] / b["ratio"]
                             for a, b in zip(legs, runs.get(base, []), strict=False)] if s["role"] == "rows" else []
        row["median_x_baseline"] = _median(row["x_baseline"])
        out["setups"][s["name"]] = row
    small = next((r for r in out["setups"].values() if r["role"] == "batch"), None)
    out["fit"] = fixed_cost(out["setups"][base], small) if small else None
    return out


def fixed_cost(big: dict, small: dict) -> dict | None:
    """Bytes per step = fixed + k x ideal, through the medians of two batch sizes on one server:
    ``fixed`` is what every step costs whatever its ids (framing, the dense part, the headers of
    its smallest packets), ``k`` what each ideal byte costs (1 + its headers); and the ratio
    bytes / ideal at each batch, ``k + fixed / ideal``."""
    b1, i1 = big["median_bytes_per_step"], big["median_ideal_per_step"]
    b2, i2 = small["median_bytes_per_step"], small["median_ideal_per_step"]
    if None in (b1, i1, b2, i2) or i1 == i2:
        return None
    k = (b1 - b2) / (i1 - i2)
    fixed = b1 - k * i1
    return {"fixed_bytes_per_step": fixed, "k": k, "batches": [big["batch_size"], small["batch_size"]],
            "ideal_per_step": [i1, i2], "ideal_for_target": fixed / (BYTES_TARGET - k) if k < BYTES_TARGET else None}


def summarize_rates(counts: list[int], runs: dict[int, list[dict]]) -> dict:
    """Per server count the medians over rounds of the totals, per server, and over the
    1-server run (the fewest servers) of the same round."""
    base = min(counts)
    out: dict = {"baseline_servers": base, "setups": {}}
    for s in counts:
        legs = runs.get(s, [])
        row: dict = {"servers": s, "rounds": len(legs)}
        for key in ("total_lookups_per_s", "total_updates_per_s", "samples_per_s", "step_ms", "machine_busy",
                    "link_utilization", "bytes_per_step"):
            values = [leg.get(key) for leg in legs]
            row[key] = values
            row[f"median_{key}"] = _median(values)
            if key.startswith("total_") or key == "samples_per_s":
                ratios = [None if v is None or not b.get(key) else v / b[key]
                          for v, b in zip(values, runs.get(base, []), strict=False)]
                row[f"x_{key}"] = ratios
                row[f"median_x_{key}"] = _median(ratios)
        for key in ("lookups_per_s", "updates_per_s", "server_cores", "lookups_per_cpu_s", "server_ms_per_step",
                    "rows"):
            per = [leg.get(key) for leg in legs if leg.get(key) is not None]
            row[f"median_{key}"] = [_median(list(x)) for x in zip(*per, strict=True)] if per else None
        out["setups"][s] = row
    return out


def targets(bytes_summary: dict | None) -> list[dict]:
    """Issue 19's bytes targets, from the medians over rounds (None where not measured)."""
    if not bytes_summary:
        return []
    rows = []
    setups = bytes_summary["setups"]
    for name, row in setups.items():
        if row.get("role") != "rows":
            continue
        v = row["median_ratio"]
        rows.append({"name": f"table bytes per trainer step / ideal, {row['label']}", "value": v, "op": "<=",
                     "target": BYTES_TARGET, "per_round": row["ratio"],
                     "met": None if v is None else v <= BYTES_TARGET})
        if name != bytes_summary["baseline"]:
            base = setups[bytes_summary["baseline"]]
            v = row["median_x_baseline"]
            rows.append({"name": f"bytes / ideal, {row['label']} over {base['label']} (same round)", "value": v,
                         "op": "within", "target": SAME_TOLERANCE, "per_round": row["x_baseline"],
                         "met": None if v is None else abs(v - 1) <= SAME_TOLERANCE})
    return rows


# ---- markdown ----------------------------------------------------------------------------------


def _f(v, fmt: str) -> str:
    return "-" if v is None else fmt.format(v)


def _fs(values: list | None, fmt: str, sep: str = " ") -> str:
    return "-" if not values else sep.join(_f(v, fmt) for v in values)


def markdown(result: dict) -> str:
    cfg = result["config"]
    lines = ["## Embedding tables (issue 19)", "", f"`{result['command']}` ({result['time']}, "
             f"{result['wall_s'] / 60:.1f} min, {cfg['cores']} cores)", ""]
    a = result.get("bytes") or {}
    if a.get("summary"):
        ca = cfg["bytes"]
        lines += [f"### (A) Table bytes per trainer step: mf on MovieLens-100k, dim {ca['dim']} (rows of "
                  f"{ca['dim'] + 1} floats), {ca['trainers']} trainers, 1 server process, links of "
                  f"{ca['rate_mbit']:g} Mbit/s, packets: {ca['packets']}", ""]
        rows = []
        for row in a["summary"]["setups"].values():
            rows.append([row["label"], str(row["batch_size"]), _f(row.get("rows_in_table"), "{:,}"),
                         _f(row.get("server_rss_mb"), "{:,.0f}"),
                         _f(row["median_ideal_per_step"], "{:,.0f}"), _f(row["median_bytes_per_step"], "{:,.0f}"),
                         _f(row["median_ratio"], "{:.3f}"), _fs(row["ratio"], "{:.3f}"),
                         f"{_f(row['median_ratio_up'], '{:.3f}')} / {_f(row['median_ratio_down'], '{:.3f}')}",
                         _f(row["median_packets_per_step"], "{:.1f}"),
                         _f(row["median_header_share"], "{:.1%}"),
                         f"{_f(row['median_payload_overhead_per_step'], '{:,.0f}')} "
                         f"({_f(row['median_payload_overhead_up_per_step'], '{:,.0f}')} / "
                         f"{_f(row['median_payload_overhead_down_per_step'], '{:,.0f}')})",
                         _f(row["median_x_baseline"], "{:.3f}"), _f(row["median_whole_run_ratio"], "{:.3f}"),
                         _f(row["median_samples_per_s"], "{:,.0f}")])
        lines += [report.md_table(
            ["setup", "batch", "rows per table at the end (status)", "server RSS MB", "ideal B/step", "measured B/step",
             "bytes / ideal (median)", "per round", "up / down", "packets per step", "headers (of ideal)",
             "other payload B/step (up / down)", "ratio x baseline (same round)", "whole run / ideal",
             "samples/s"], rows), ""]
        pk = a.get("rpc_pickles")
        if pk:
            lines += [f"Pickled parts of one step's exchange (torch's RPC pickler, computed here): the call up "
                      f"{pk['request']} B (of which the trainer's progress report, carried on every call, "
                      f"{pk['report']} B), the reply down {pk['reply']} B; {pk['request_tensors']} tensors up and "
                      f"{pk['reply_tensors']} down. The rest of the other payload is torch RPC's and TensorPipe's "
                      "framing of the two messages and their tensors, and one heartbeat per trainer per second.", ""]
        fit = a["summary"].get("fit")
        if fit:
            lines += [f"Bytes per step = fixed + k x ideal, through batches {fit['batches'][0]} and "
                      f"{fit['batches'][1]} (medians): fixed = {fit['fixed_bytes_per_step']:,.0f} B per step, "
                      f"k = {fit['k']:.3f}" + (f"; <= {BYTES_TARGET:g}x from an ideal of "
                                               f"{fit['ideal_for_target']:,.0f} B per step on"
                                               if fit.get("ideal_for_target") else "") + ".", ""]
    if result.get("targets"):
        trows = [[t["name"], _f(t["value"], "{:.3f}"), _fs(t["per_round"], "{:.3f}"),
                  f"{t['op']} {t['target']:g}" if t["op"] != "within" else f"1 +- {t['target']:g}",
                  "-" if t["met"] is None else ("yes" if t["met"] else "NO")] for t in result["targets"]]
        lines += ["Targets (issue 19, medians over paired rounds):", "",
                  report.md_table(["ratio", "measured", "per round", "target", "met"], trows), ""]
    b = result.get("rates") or {}
    if b.get("summary"):
        cb = cfg["rates"]
        lines += [f"### (B) Row lookups and updates per second: dlrm_tiny on synthetic_clicks, dim {cb['dim']}, "
                  f"{cb['trainers']} trainers, batch {cb['batch_size']}, links of {cb['rate_mbit']:g} Mbit/s", ""]
        rows = []
        for s, row in b["summary"]["setups"].items():
            rows.append([str(s), _f(row["median_total_lookups_per_s"], "{:,.0f}"),
                         _f(row.get("median_x_total_lookups_per_s"), "{:.2f}"),
                         _fs(row.get("x_total_lookups_per_s"), "{:.2f}"),
                         _fs(row["median_lookups_per_s"], "{:,.0f}", " / "),
                         _f(row["median_total_updates_per_s"], "{:,.0f}"),
                         _f(row.get("median_x_total_updates_per_s"), "{:.2f}"),
                         _fs(row["median_updates_per_s"], "{:,.0f}", " / "),
                         _f(row["median_samples_per_s"], "{:,.0f}"),
                         _fs(row["median_server_cores"], "{:.2f}", " / "),
                         _fs(row["median_lookups_per_cpu_s"], "{:,.0f}", " / "),
                         _fs(row["median_server_ms_per_step"], "{:.2f}", " / "),
                         _f(row["median_link_utilization"], "{:.0%}"), _f(row["median_machine_busy"], "{:.0%}")])
        lines += [report.md_table(
            ["servers", "lookups/s, total (median)", "x 1 server", "per round", "lookups/s per server",
             "updates/s, total", "x 1 server", "updates/s per server", "samples/s", "server CPU (cores each)",
             "lookups per server CPU-second", "server CPU ms per trainer step", "server links busy",
             "machine CPU busy"], rows), ""]
    for part, key in (("(A)", "bytes"), ("(B)", "rates")):
        if (result.get(key) or {}).get("error"):
            lines += [f"**{part} stopped early:** {result[key]['error']}", ""]
    if result.get("error"):
        lines += [f"**Stopped early:** {result['error']}", ""]
    lines += [METHOD, ""]
    return "\n".join(lines).rstrip() + "\n"


METHOD = ("Method: every server process and trainer in a network namespace of its own behind a tc-limited veth link "
          "to one bridge (benchmarks/multihost.py), servers with TensorPipe's basic channel; one torch thread each. "
          "(A) bytes over the server's link, both directions, headers included (bridge-port counters every 0.1 s), "
          "between the first and last readings inside the interval in which every trainer steps; the ideal of the "
          "steps that end between them, computed per step from the trainers' own batches and checked against their "
          "row_payload_bytes; 'headers' = 66 B per packet; 'other payload' = bytes - headers - ideal. (B) each server "
          "process's lookups and updates counters (server 0's status, read every 0.5 s in its namespace) between "
          "its first and last readings inside that interval. Ratios to the baseline of the same round; medians over "
          "rounds (benchmarks/embedding_tables.py).")


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
            for p in procs:
                code = p.wait(self.deadline.left())
                if code is None:
                    self.deadline.left()  # raises when the global timeout is what ran out
                    raise RuntimeError(f"{p.name} still running after {scaling.LEG_TIMEOUT_S:.0f} s:\n{p.tail()}")
                if code != 0:
                    raise RuntimeError(f"{p.name} exited with {code}:\n{p.tail()}")
        finally:
            for p in procs:
                p.stop()
            self.children.items = [c for c in self.children.items if c not in procs]


def elapsed(deadline: scaling.Deadline) -> float:
    return time.monotonic() - (deadline.end - deadline.seconds)


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def bytes_setups(args: argparse.Namespace) -> list[dict]:
    """(A)'s setups: one per prefill at ``--bytes-batch`` (role ``rows``), then the smallest
    prefill at ``--small-batch`` (role ``batch``): the same fixed cost per step over fewer ids."""
    def label(n: int) -> str:
        e = len(str(n)) - 1
        return f"10^{e} rows" if n == 10 ** e else f"{n:,} rows"

    out = [{"name": f"rows{n}-b{args.bytes_batch}", "role": "rows", "prefill": n, "batch_size": args.bytes_batch,
            "label": label(n)} for n in args.rows]
    if args.small_batch:
        n = args.rows[0]
        out.append({"name": f"rows{n}-b{args.small_batch}", "role": "batch", "prefill": n,
                    "batch_size": args.small_batch, "label": f"{label(n)}, batch {args.small_batch}"})
    return out


def measure_bytes(args: argparse.Namespace, deadline: scaling.Deadline, progress: dict) -> None:
    """(A): fills ``progress`` (setups, runs, servers) as it goes."""
    setups = bytes_setups(args)
    prefills = list(args.rows)
    trainers = args.bytes_trainers
    runs: dict[str, list[dict]] = {s["name"]: [] for s in setups}
    try:
        pickles = rpc_pickle_sizes(args.bytes_dim)
    except (ImportError, AttributeError, TypeError) as e:  # torch's private pickler moved: only the breakdown goes
        log.warning("cannot size the pickled exchange: %s", e)
        pickles = None
    progress.update(setups=setups, runs=runs, order_per_round=[], servers={}, rpc_pickles=pickles)
    ids = movielens_ids()
    columns = mf_columns(args.bytes_dim)
    trainer_nodes = list(range(len(prefills), len(prefills) + trainers))
    with tempfile.TemporaryDirectory(prefix="psserver-tables-a-") as tmp:
        hosts = Hosts(len(prefills) + trainers, args.bytes_rate, Path(tmp), deadline, packets=args.packets)
        try:
            log.info("[%5.0fs] (A) %d nodes, links of %g Mbit/s, packets %s; prefilling %s rows per table",
                     elapsed(deadline), len(hosts.topo), args.bytes_rate, args.packets,
                     " and ".join(f"{n:,}" for n in prefills))
            servers: dict[int, measure.Child] = {}
            for k, n in enumerate(prefills):  # all prefill at once; each waits below
                head = hosts.topo.address(k)
                servers[n] = hosts.start(k, scaling.server_command(server_args(
                    0, 1, host=head, coordinator=head, model="mf", dim=args.bytes_dim, prefill=n)), f"rows{n}-server0")
            for n, p in servers.items():
                p.wait_for(scaling.READY_RANK0, deadline.left(600))
                log.info("[%5.0fs] (A) server with %s rows per table serving", elapsed(deadline), f"{n:,}")

            def run(setup: dict, tag: str, steps: int, measure_it: bool = True) -> dict:
                k = prefills.index(setup["prefill"])
                server = servers[setup["prefill"]]
                head = hosts.topo.address(k)
                stats = [hosts.work / f"{tag}-trainer{r}.json" for r in range(trainers)]
                jobs = [(node, trainer_args(r, trainers, server=head, batch_size=setup["batch_size"], steps=steps,
                                            dataset="movielens100k", stats_out=stats[r]))
                        for r, node in enumerate(trainer_nodes)]
                sampler = Sampler(hosts.topo, [server.pid]).start()
                try:
                    hosts.run_trainers(tag, jobs, [server])
                finally:
                    readings = sampler.stop()
                if not measure_it:
                    return {}
                got = [json.loads(f.read_text()) for f in stats]
                ends = [g["step_ends"] for g in got]
                ideals = [step_ideals(ids, rank=r, trainers=trainers, batch_size=setup["batch_size"],
                                      steps=len(ends[r]), columns=columns) for r in range(trainers)]
                counted = [g.get("row_payload_bytes") for g in got]
                computed = [sum(u + d for u, d in i) for i in ideals]
                if counted != computed:
                    raise RuntimeError(f"the ideal computed per step ({computed}) is not what the trainers counted "
                                       f"({counted}): the benchmark's batches are not the trainers'")
                leg = bytes_window(readings, k, ends, ideals, setup["batch_size"], args.bytes_skip)
                whole = readings[-1].links[k].bytes - readings[0].links[k].bytes
                leg.update(whole_run_bytes=whole, row_payload_bytes=sum(counted),
                           whole_run_ratio=whole / sum(counted) if sum(counted) else None)
                return leg

            for setup in setups:
                if args.warm_up_steps and setup["role"] == "rows":
                    run(setup, f"warm-up-{setup['name']}", args.warm_up_steps, measure_it=False)
            for r in range(args.bytes_rounds):
                order = setups[r % len(setups):] + setups[:r % len(setups)]
                progress["order_per_round"].append([s["name"] for s in order])
                for setup in order:
                    leg = run(setup, f"a-r{r}-{setup['name']}", args.bytes_steps)
                    runs[setup["name"]].append(leg)
                    log.info("[%5.0fs] (A) round %d/%d, %s: %s", elapsed(deadline), r + 1, args.bytes_rounds,
                             setup["label"], _bytes_line(leg))
                progress["rounds_done"] = r + 1
            for n, p in servers.items():  # what the tables held: the prefill and the rows the runs created
                status = hosts.status_once(prefills.index(n), f"rows{n}-status")
                rows = None if status is None else {t["table"]: t["rows"] for t in status["tables"]}
                progress["servers"][n] = {"rows": rows, "rss_mb": _rss_mb(p.pid)}
                log.info("[%5.0fs] (A) server prefilled with %s rows: rows per table %s, RSS %s MB", elapsed(deadline),
                         f"{n:,}", rows, _f(_rss_mb(p.pid), "{:,.0f}"))
        finally:
            hosts.close()


def _bytes_line(leg: dict) -> str:
    return (f"{leg['window_steps']} steps in {leg['window_s']:.1f} s, {leg['bytes_per_step']:,.0f} B/step, ideal "
            f"{leg['ideal_per_step']:,.0f}: {leg['ratio']:.3f}x (up {leg['ratio_up']:.3f}, down "
            f"{leg['ratio_down']:.3f}; {leg['packets_per_step']:.1f} packets/step, headers {leg['header_share']:.1%}, "
            f"other payload {leg['payload_overhead_per_step']:,.0f} B/step); whole run {leg['whole_run_ratio']:.3f}x")


def measure_rates(args: argparse.Namespace, deadline: scaling.Deadline, progress: dict) -> None:
    """(B): fills ``progress`` (runs per server count) as it goes."""
    counts = args.servers
    lay = scaling.layout(counts, args.trainers)
    runs: dict[int, list[dict]] = {s: [] for s in counts}
    progress.update(runs=runs, order_per_round=[])
    extra = ("--train-samples", str(args.train_samples), "--eval-samples", str(args.eval_samples))
    with tempfile.TemporaryDirectory(prefix="psserver-tables-b-") as tmp:
        hosts = Hosts(lay.nodes, args.rate, Path(tmp), deadline, qdisc=args.qdisc)
        try:
            log.info("[%5.0fs] (B) %d nodes, links of %g Mbit/s", elapsed(deadline), lay.nodes, args.rate)
            groups: dict[int, list[measure.Child]] = {}
            pollers: dict[int, measure.Child] = {}

            def run(s: int, tag: str, steps: int, measure_it: bool = True) -> dict:
                nodes = lay.servers[s]
                head = hosts.topo.address(nodes[0])
                stats = [hosts.work / f"{tag}-trainer{r}.json" for r in range(args.trainers)]
                jobs = [(node, trainer_args(r, args.trainers, server=head, batch_size=args.batch_size, steps=steps,
                                            dataset="synthetic_clicks", stats_out=stats[r], extra=extra))
                        for r, node in enumerate(lay.trainers)]
                sampler = Sampler(hosts.topo, [p.pid for p in groups[s]]).start()
                try:
                    hosts.run_trainers(tag, jobs, groups[s])
                finally:
                    readings = sampler.stop()
                if not measure_it:
                    return {}
                ends = [json.loads(f.read_text())["step_ends"] for f in stats]
                return rates_window(readings, poll_lines(pollers[s].output()), ends, servers=s, server_nodes=nodes,
                                    server_pids=[p.pid for p in groups[s]], batch_size=args.batch_size,
                                    skip=args.skip, rate_mbit=args.rate)

            for s in counts:
                groups[s] = hosts.start_group(lay.servers[s], lambda rank, host, head, s=s: server_args(
                    rank, s, host=host, coordinator=head, model="dlrm_tiny", dim=args.dim), f"s{s}")
                pollers[s] = hosts.poller(lay.servers[s][0], f"s{s}-status", deadline.left(1e9))
                log.info("[%5.0fs] (B) %d server process(es) serving", elapsed(deadline), s)
                if args.warm_up_steps:
                    run(s, f"warm-up-s{s}", args.warm_up_steps, measure_it=False)
            for r in range(args.rounds):
                order = counts[r % len(counts):] + counts[:r % len(counts)]
                progress["order_per_round"].append(order)
                for s in order:
                    leg = run(s, f"b-r{r}-s{s}", args.steps)
                    runs[s].append(leg)
                    log.info("[%5.0fs] (B) round %d/%d, %d server(s): %s", elapsed(deadline), r + 1, args.rounds, s,
                             _rates_line(leg))
                progress["rounds_done"] = r + 1
        finally:
            hosts.close()


def _rates_line(leg: dict) -> str:
    return (f"{leg['samples_per_s']:,.0f} samples/s, lookups/s {_f(leg['total_lookups_per_s'], '{:,.0f}')} "
            f"({_fs(leg['lookups_per_s'], '{:,.0f}', ' / ')}), updates/s {_f(leg['total_updates_per_s'], '{:,.0f}')}, "
            f"server CPU {_fs(leg.get('server_cores'), '{:.2f}', ' / ')} cores, links "
            f"{_f(leg.get('link_utilization'), '{:.0%}')} busy, machine {_f(leg.get('machine_busy'), '{:.0%}')} busy")


# ---- command line --------------------------------------------------------------------------------


def _ints(text: str, flag: str, p: argparse.ArgumentParser) -> list[int]:
    try:
        return sorted({int(float(x)) for x in text.split(",") if x.strip()})
    except ValueError:
        p.error(f"{flag}: comma-separated integers, got {text!r}")
        raise  # unreachable: p.error exits


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.embedding_tables", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="(A) 10^4 and 10^5 rows, 1 round; (B) 1 and 2 servers, 4 trainers, 1 round (< 90 s)")
    p.add_argument("--timeout", type=float, default=780.0,
                   help="seconds for the whole run; past it everything is stopped and what was measured is written "
                        "(default 780)")
    p.add_argument("--results-dir", type=Path, default=DEFAULT_RESULTS, help="where the JSON and Markdown go")
    p.add_argument("--skip-bytes", action="store_true", help="leave (A) out")
    p.add_argument("--skip-rates", action="store_true", help="leave (B) out")
    a = p.add_argument_group("(A) bytes per step (mf, MovieLens-100k, 1 server process per prefill)")
    a.add_argument("--rows", default=None, help="rows per table to prefill, comma-separated, smallest first "
                                                "(default 1e4,1e7; --quick 1e4,1e5)")
    a.add_argument("--bytes-batch", type=int, default=1024, help="samples per trainer step (default 1024)")
    a.add_argument("--small-batch", type=int, default=None,
                   help="also the smallest prefill at this batch: the fixed cost per step (default 128; --quick 0: "
                        "none)")
    a.add_argument("--bytes-dim", type=int, default=8, help="--embedding-dim (default 8: rows of 9 floats)")
    a.add_argument("--bytes-trainers", type=int, default=2, help="trainers (default 2)")
    a.add_argument("--bytes-steps", type=int, default=None, help="steps per trainer and run (default 400; --quick 150)")
    a.add_argument("--bytes-skip", type=int, default=20, help="warm-up steps of each trainer left out (default 20)")
    a.add_argument("--bytes-rounds", type=int, default=None, help="paired rounds (default 3; --quick 1)")
    a.add_argument("--bytes-rate", type=float, default=200.0,
                   help="Mbit/s of every link, each way (default 200, issue 18's: the links do not bound these runs)")
    a.add_argument("--packets", choices=("mtu", "gso"), default="mtu",
                   help="mtu: every TCP segment its own frame with its own headers, as on a wire (default); gso: "
                        "veth's default, one counted packet for up to 64 KB")
    b = p.add_argument_group("(B) lookups and updates per second (dlrm_tiny, synthetic_clicks)")
    b.add_argument("--servers", default=None, help="server counts, comma-separated (default 1,2,4; --quick 1,2)")
    b.add_argument("--trainers", type=int, default=None, help="trainers, each on its own link (default 8; --quick 4)")
    b.add_argument("--rate", type=float, default=25.0,
                   help="Mbit/s of every link, each way (default 25: one server's link bounds the 1-server run)")
    b.add_argument("--qdisc", choices=multihost.QDISCS, default="tbf", help="tc shaper (default tbf)")
    b.add_argument("--dim", type=int, default=16, help="--embedding-dim (default 16, dlrm_tiny's)")
    b.add_argument("--batch-size", type=int, default=512, help="samples per trainer step (default 512)")
    b.add_argument("--steps", type=int, default=None, help="steps per trainer and run (default 100; --quick 60)")
    b.add_argument("--skip", type=int, default=5, help="warm-up steps of each trainer left out (default 5)")
    b.add_argument("--rounds", type=int, default=None, help="paired rounds (default 3; --quick 1)")
    b.add_argument("--train-samples", type=int, default=50_000, help="synthetic_clicks samples (default 50000)")
    b.add_argument("--eval-samples", type=int, default=2_000,
                   help="held-out samples each trainer evaluates after its run (default 2000)")
    p.add_argument("--warm-up-steps", type=int, default=None,
                   help="steps per trainer of one unmeasured run against each server (default 20; --quick 0)")
    args = p.parse_args(argv)
    q = args.quick
    args.rows = _ints(args.rows or ("1e4,1e5" if q else "1e4,1e7"), "--rows", p)
    args.servers = _ints(args.servers or ("1,2" if q else "1,2,4"), "--servers", p)
    for name, full, quick in (("small_batch", 128, 0), ("bytes_steps", 400, 150), ("bytes_rounds", 3, 1),
                              ("trainers", 8, 4), ("steps", 100, 60), ("rounds", 3, 1), ("warm_up_steps", 20, 0)):
        if getattr(args, name) is None:
            setattr(args, name, quick if q else full)
    if not args.rows or args.rows[0] < 0 or args.rows[-1] > 100_000_000:
        p.error("--rows: counts in 0..1e8")
    if not args.servers or args.servers[0] < 1 or args.servers[-1] > 64:
        p.error("--servers: counts in 1..64")
    if min(args.bytes_batch, args.bytes_dim, args.bytes_trainers, args.bytes_rounds, args.trainers, args.dim,
           args.batch_size, args.rounds, args.train_samples, args.eval_samples) < 1 \
            or args.small_batch < 0 or args.warm_up_steps < 0 or args.bytes_skip < 0 or args.skip < 0:
        p.error("batch sizes, dims, trainers, rounds and samples must be >= 1; skips and warm-up steps >= 0")
    if args.bytes_steps < args.bytes_skip + 6 or args.steps < args.skip + 6:
        p.error("need --bytes-steps >= --bytes-skip + 6 and --steps >= --skip + 6")
    if args.rate <= 0 or args.bytes_rate <= 0 or args.timeout <= 0:
        p.error("need --rate, --bytes-rate and --timeout > 0")
    if sum(args.servers) + args.trainers > 250 or len(args.rows) + args.bytes_trainers > 250:
        p.error("too many nodes (at most 250 per topology)")
    if args.skip_bytes and args.skip_rates:
        p.error("--skip-bytes and --skip-rates leave nothing to measure")
    return args


def command_line(args: argparse.Namespace) -> str:
    cmd = ["python -m benchmarks.embedding_tables"]
    if not args.skip_bytes:
        cmd.append(f"--rows {','.join(str(n) for n in args.rows)} --bytes-batch {args.bytes_batch} --small-batch "
                   f"{args.small_batch} --bytes-dim {args.bytes_dim} --bytes-trainers {args.bytes_trainers} "
                   f"--bytes-steps {args.bytes_steps} --bytes-skip {args.bytes_skip} --bytes-rounds "
                   f"{args.bytes_rounds} --bytes-rate {args.bytes_rate:g} --packets {args.packets}")
    if not args.skip_rates:
        cmd.append(f"--servers {','.join(map(str, args.servers))} --trainers {args.trainers} --rate {args.rate:g} "
                   f"--dim {args.dim} --batch-size {args.batch_size} --steps {args.steps} --skip {args.skip} "
                   f"--rounds {args.rounds}" + (f" --qdisc {args.qdisc}" if args.qdisc != "tbf" else ""))
    cmd.append(f"--warm-up-steps {args.warm_up_steps} --timeout {args.timeout:g}")
    for flag in ("quick", "skip_bytes", "skip_rates"):
        if getattr(args, flag):
            cmd.append("--" + flag.replace("_", "-"))
    return " ".join(cmd)


def _config(args: argparse.Namespace) -> dict:
    return {"cores": os.cpu_count(), "load_avg_at_start": os.getloadavg(), "quick": args.quick,
            "bytes": {"rows": args.rows, "batch_size": args.bytes_batch, "small_batch": args.small_batch,
                      "dim": args.bytes_dim, "trainers": args.bytes_trainers, "steps": args.bytes_steps,
                      "skip": args.bytes_skip, "rounds": args.bytes_rounds, "rate_mbit": args.bytes_rate,
                      "packets": args.packets},
            "rates": {"servers": args.servers, "trainers": args.trainers, "rate_mbit": args.rate, "dim": args.dim,
                      "batch_size": args.batch_size, "steps": args.steps, "skip": args.skip, "rounds": args.rounds,
                      "train_samples": args.train_samples, "qdisc": args.qdisc},
            "warm_up_steps": args.warm_up_steps}


def _run_part(fn, args: argparse.Namespace, deadline: scaling.Deadline, progress: dict) -> str | None:
    """``fn``, its failure as one line (what it measured stays in ``progress``)."""
    try:
        fn(args, deadline, progress)
    except (TimeoutError, RuntimeError, OSError, ValueError) as e:
        log.error("stopped: %s: %s", type(e).__name__, e)
        return f"{type(e).__name__}: {e}"
    return None


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    reason = multihost.available()
    if reason:
        log.error("cannot build the namespaces this benchmark needs: %s", reason)
        return 2
    t0 = time.monotonic()
    deadline = scaling.Deadline(args.timeout)
    a: dict = {}
    b: dict = {}
    errors: dict[str, str | None] = {"bytes": None, "rates": None}
    error = None
    with paired.exit_on_sigterm():
        try:
            if not args.skip_bytes:
                errors["bytes"] = _run_part(measure_bytes, args, deadline, a)
            if not args.skip_rates and not (errors["bytes"] or "").startswith("TimeoutError"):
                errors["rates"] = _run_part(measure_rates, args, deadline, b)
        except SystemExit as e:  # SIGTERM: everything is stopped; write what was measured
            error = f"stopped by SIGTERM (exit {e.code})"
    result: dict = {"command": command_line(args), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                    "wall_s": time.monotonic() - t0, "config": _config(args), "method": METHOD, "error": error}
    if not args.skip_bytes:
        part: dict = {"error": errors["bytes"], "order_per_round": a.get("order_per_round", []),
                      "runs": a.get("runs", {}), "servers": a.get("servers", {}), "rpc_pickles": a.get("rpc_pickles")}
        done = a.get("rounds_done", 0)
        if done:
            summary = summarize_bytes(a["setups"], {k: v[:done] for k, v in a["runs"].items()})
            for row in summary["setups"].values():
                server = a["servers"].get(row["prefill"], {})
                row["rows_in_table"] = min(server["rows"].values()) if server.get("rows") else None
                row["server_rss_mb"] = server.get("rss_mb")
            part["summary"] = summary
            result["targets"] = targets(summary)
        result["bytes"] = part
    if not args.skip_rates:
        part = {"error": errors["rates"], "order_per_round": b.get("order_per_round", []), "runs": b.get("runs", {})}
        done = b.get("rounds_done", 0)
        if done:
            part["summary"] = summarize_rates(args.servers, {k: v[:done] for k, v in b["runs"].items()})
        result["rates"] = part
    args.results_dir.mkdir(parents=True, exist_ok=True)
    stem = args.results_dir / "embedding-tables"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1, default=str))
    md = markdown(result)
    stem.with_suffix(".md").write_text(md)
    sys.stdout.write(md)
    log.info("wrote %s.json and .md", stem)
    return 0 if error is None and not any(errors.values()) else 3


if __name__ == "__main__":
    sys.exit(main())
