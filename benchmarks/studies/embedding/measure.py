"""Embedding tables benchmark: the counters it reads and the windows it computes.

``benchmarks.studies.embedding.tables`` runs the servers and trainers; this module only reads and computes:
each node's link counters (the bridge ports'), the CPU time of the server processes and of the
machine (``Sampler``), a process's resident memory, the ideal bytes of every trainer step from the
trainers' own batches, the status lines of server 0's poller, and one run's window in which every
trainer steps, with its bytes against the ideal (A) or each server's lookups and updates per
second (B). Kept apart from the orchestration so that these parts are tested without namespaces
or processes; it imports no other ``embedding_*`` module."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.harness import measure, multihost, paired_stats

log = logging.getLogger(__name__)

HEADER_BYTES = 66
"""Ethernet (14) + IPv4 (20) + TCP (20) + TCP timestamps (12) per packet."""
WIRE_BYTES = 4
"""fp32 rows and row gradients (``--wire-dtype fp32``, the trainers' default)."""


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


def _rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


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


def around(readings: list, t0: float, t1: float) -> tuple | None:
    """The last of ``readings`` at or before ``t0`` (else the first) and the first at or after
    ``t1`` (else the last): a window a little wider than [t0, t1], for a run too short or too
    disturbed to hold two readings inside it."""
    def t(r) -> float:
        return r.t if hasattr(r, "t") else r[0]

    if len(readings) < 2:
        return None
    before = [r for r in readings if t(r) <= t0] or readings[:1]
    after = [r for r in readings if t(r) >= t1] or readings[-1:]
    a, b = before[-1], after[0]
    return (a, b) if t(b) > t(a) else (readings[0], readings[-1]) if t(readings[-1]) > t(readings[0]) else None


# ---- (A): the ideal bytes of every step -------------------------------------------------------


def step_ideals(ids, *, rank: int, trainers: int, batch_size: int, steps: int, columns: list[tuple[int, int]],
                seed: int = 0, wire_bytes: int = WIRE_BYTES) -> list[tuple[int, int]]:
    """(up, down) ideal bytes of each of a trainer's ``steps`` steps: up, each unique id of every
    table (8 bytes) and its row gradient; down, its row (``columns``: (id column, row width) of
    each table). The batches are the trainer's: ``DistributedSampler(shuffle=True, seed)`` over
    the training set, ``set_epoch`` per epoch, consecutive slices of ``batch_size``
    (``psserver.trainer.loop``); ``ids`` is the training set's id tensor."""
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

    from psserver.common import calls
    from psserver.common.messages import Report
    from psserver.models import get_model_spec

    names = [d.name for d in get_model_spec("mf").tables]
    rows = {"grads": {n: torch.zeros(10, dim + 1) for n in names},
            "ids": {n: torch.zeros(10, dtype=torch.int64) for n in names}}
    report = Report(steps=1234, samples=1_263_616, loss=0.8813, samples_per_s=106_496.2)
    call = ("trainer_0_1", "exchange", ([torch.zeros(1)], 1024, None, rows))
    up, up_tensors = _internal_rpc_pickler.serialize(PythonUDF(calls.call, (*call, report), {}))
    bare, _ = _internal_rpc_pickler.serialize(PythonUDF(calls.call, (*call, None), {}))
    down, down_tensors = _internal_rpc_pickler.serialize((([torch.zeros(1)], {n: torch.zeros(10, dim + 1)
                                                                               for n in names}), []))
    return {"request": len(up), "report": len(up) - len(bare), "reply": len(down),
            "request_tensors": len(up_tensors), "reply_tensors": len(down_tensors)}


# ---- (A): one run's analysis --------------------------------------------------------------------


def bytes_window(readings: list[Reading], node: int, ends: list[list[float]], ideals: list[list[tuple[int, int]]],
                 batch_size: int, skip: int) -> dict:
    """Bytes over ``node``'s link against the ideal of the steps that end between the first and
    last readings inside the run's window (``paired_stats.leg_rate``: every trainer steps, ``skip``
    steps each left out). ``ideals``: (up, down) of each trainer's steps, in order."""
    leg = paired_stats.leg_rate(ends, batch_size, skip)
    pair = inside(readings, leg["start"], leg["end"])
    if pair is None:  # a loaded machine: the readings nearest the window's ends, the figure flagged
        pair = around(readings, leg["start"], leg["end"])
        if pair is None:
            raise RuntimeError("fewer than two counter readings in the whole run (raise --bytes-steps)")
        leg[paired_stats.DISTURBED] = "fewer than two counter readings inside the run's window: the nearest outside it"
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
    leg = paired_stats.leg_rate(ends, batch_size, skip)
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
