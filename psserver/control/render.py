"""The human-readable ``psserver status`` table, from control-plane messages.

Plain text, fixed columns, no colour: it must read the same in a terminal, a CI log and
``watch -n1``. Ages are computed against the server's clock (``server_time``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence

from psserver.control.convert import enum_name
from psserver.control.v1 import control_pb2 as pb
from psserver.utils.units import human_bytes

log = logging.getLogger(__name__)


def human_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    s = int(seconds)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d {h:02d}h"
    if h:
        return f"{h}h {m:02d}m"
    if m:
        return f"{m}m {s:02d}s"
    return f"{s}s"


def _ago(t: float, now: float) -> str:
    return f"{human_duration(now - t)} ago" if t > 0 else "-"


def _loss(msg: pb.ServerStatus | pb.Trainer, field: str) -> str:
    return f"{getattr(msg, field):.4g}" if msg.HasField(field) else "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[int] = ()) -> list[str]:
    """Left-aligned text columns, right-aligned numeric ones, two spaces apart."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))]
        return "  ".join(out).rstrip()

    return [line(headers), *(line(r) for r in rows)]


def render_status(status: pb.ServerStatus, trainers: Sequence[pb.Trainer] | None = None, address: str = "") -> str:
    now = status.server_time or status.started_at + status.uptime_seconds
    update = enum_name(pb.UpdateMode, status.update_mode).lower()
    if status.update_mode == pb.UPDATE_MODE_SYNC:
        update += f" (one step per {status.sync_trainers} gradients)"
    elif status.update_mode == pb.UPDATE_MODE_DILOCO:
        update += f" ({status.diloco})"
    elif status.update_mode == pb.UPDATE_MODE_SSP:
        update += (" (bulk-synchronous: staleness 0)" if status.staleness == 0 else
                   f" (no trainer more than {status.staleness} steps ahead of the slowest)")
    where = f" at {address}" if address else ""
    lines = [
        f"psserver {status.version}{where}  {enum_name(pb.ServerState, status.state)}"
        f"  (mode {enum_name(pb.Mode, status.mode).lower()}, up {human_duration(status.uptime_seconds)})",
        f"model       {status.model}, {status.num_params:,} parameters",
        f"updates     {update}",
        f"progress    step {status.global_step:,}, {status.samples_seen:,} samples, "
        f"{status.updates_per_second:.1f} updates/s, {status.samples_per_second:.1f} samples/s, "
        f"loss {_loss(status, 'mean_loss')}",
    ]
    if status.HasField("learning_rate"):
        lines.append(f"lr          {status.learning_rate:.6g}"
                     f"{f' ({status.lr_schedule})' if status.lr_schedule else ' (constant)'}")
    if status.nonfinite_gradients or status.clipped_steps:
        lines.append(f"guard       {status.nonfinite_gradients:,} non-finite gradients dropped, "
                     f"{status.clipped_steps:,} steps clipped to --max-grad-norm")
    if status.HasField("last_checkpoint"):
        ck = status.last_checkpoint
        lines.append(f"checkpoint  {ck.path} (step {ck.step:,}, {_ago(ck.time, now)})")
    else:
        lines.append("checkpoint  none")
    if status.memory_state:
        lines.append(f"memory      {status.memory_state}")
    for x in status.stale_state:
        lines.append(f"stale       {x.path} ({human_bytes(x.bytes)}, run {x.run or '?'}, pid {x.pid}, "
                     f"{_ago(x.started_at, now)}): a job that is gone left it; psserver serve "
                     "--remove-stale-state deletes it")
    lines.append("")
    rows = [
        [str(s.index), s.device, f"{s.num_params:,}", human_bytes(s.bytes),
         human_bytes(s.state_bytes) if s.state_bytes else "-"]
        for s in status.shards
    ]
    # SIZE: the parameters; WITH OPTIMIZER: and the optimizer's state (not the process's memory).
    lines += table(["SHARD", "DEVICE", "PARAMS", "SIZE", "WITH OPTIMIZER"], rows, numeric=(0, 2, 3, 4))
    if len(status.servers) > 1:
        lines.append("")
        lines += render_servers(status.servers).splitlines()
    if status.tables:
        lines.append("")
        lines += render_tables(status.tables).splitlines()
    if status.readers:
        lines.append("")
        lines += render_readers(status.readers, now).splitlines()
    if trainers is not None:
        lines.append("")
        lines += render_trainers(trainers, now).splitlines()
    return "\n".join(lines)


def render_readers(readers: Sequence[pb.WeightReader], now: float) -> str:
    """The readers of the weights: the version each holds and how fresh it was when it had it."""
    rows = [[r.name, r.peer if r.peer != r.name else "-", f"{r.step:,}", f"{r.age_seconds * 1e3:.0f} ms",
             f"{r.reads:,}", str(max(1, r.sharing)), _ago(r.read_at, now)] for r in readers]
    # HOST: the readers on its host that read the one copy this reader fetches for them.
    return "\n".join(table(["READER", "PEER", "STEP", "AGE", "READS", "HOST", "LAST READ"], rows,
                           numeric=(2, 3, 4, 5)))


def render_servers(servers: Sequence[pb.ServerProcess]) -> str:
    """The server processes of a parameter server spread over several, with each one's share of
    the parameter bytes: a lopsided partition is the first suspect of a slow job."""
    counts = dict.fromkeys(("SERVING", "LOST", "MISSING"), 0)
    for s in servers:
        name = enum_name(pb.ServerProcessState, s.state)
        counts[name] = counts.get(name, 0) + 1
    summary = ", ".join(f"{n} {k.lower()}" for k, n in counts.items())
    total = sum(s.bytes for s in servers)
    rows = [
        [
            str(s.rank),
            s.name,
            s.host,
            enum_name(pb.ServerProcessState, s.state),
            f"{s.num_params:,}",
            human_bytes(s.bytes),
            f"{100.0 * s.bytes / total:.1f}%" if total > 0 else "-",
            f"{s.updates_applied:,}",
            f"{human_duration(s.last_seen_age_seconds)} ago" if s.HasField("last_seen_age_seconds") else "-",
        ]
        for s in servers
    ]
    head = ["SERVER", "NAME", "HOST", "STATE", "PARAMS", "SIZE", "SHARE", "UPDATES", "LAST SEEN"]
    return "\n".join([f"SERVERS     {summary}", *table(head, rows, numeric=(0, 4, 5, 6, 7))])


def render_tables(tables: Sequence[pb.EmbeddingTable]) -> str:
    """The embedding tables, one line per table per server process: a table at its row bound
    evicts (EVICTED grows), and refused lookups are ids not admitted yet."""
    names = {t.table for t in tables}
    servers = {t.server_rank for t in tables}
    summary = (f"{len(names)} table{'s' if len(names) != 1 else ''} on {len(servers)} "
               f"server{'s' if len(servers) != 1 else ''}, {sum(t.rows for t in tables):,} rows, "
               f"{human_bytes(sum(t.bytes for t in tables))}")
    rows = [
        [
            t.table,
            str(t.server_rank),
            f"{t.rows:,}",
            f"{t.max_rows:,}",
            human_bytes(t.bytes),
            f"{t.admissions:,}",
            f"{t.refused:,}",
            f"{t.evictions:,}",
            f"{t.expirations:,}",
            f"{t.lookups_per_second:,.1f}",
            f"{t.updates_per_second:,.1f}",
        ]
        for t in tables
    ]
    head = ["TABLE", "SERVER", "ROWS", "MAX", "BYTES", "ADMITTED", "REFUSED", "EVICTED", "EXPIRED", "LOOKUPS/S",
            "UPDATES/S"]
    return "\n".join([f"TABLES      {summary}", *table(head, rows, numeric=tuple(range(1, len(head))))])


def render_trainers(trainers: Sequence[pb.Trainer], now: float) -> str:
    counts = dict.fromkeys(("ACTIVE", "LEFT", "LOST"), 0)
    for t in trainers:
        name = enum_name(pb.TrainerState, t.state)
        counts[name] = counts.get(name, 0) + 1
    summary = ", ".join(f"{n} {k.lower()}" for k, n in counts.items())
    if not trainers:
        return "TRAINERS    none joined yet"
    rows = [
        [
            str(t.rank),
            t.name,
            t.host,
            t.step or "-",
            t.transport or "-",
            enum_name(pb.TrainerState, t.state),
            f"{t.steps:,}",
            f"{t.samples:,}",
            _loss(t, "last_loss"),
            f"{t.samples_per_second:.1f}",
            *_progress(t),
            f"{t.nonfinite:,}",
            _ago(t.joined_at, now),
            _ago(t.last_seen, now),
        ]
        for t in trainers
    ]
    head = ["RANK", "NAME", "HOST", "STEP", "TRANSPORT", "STATE", "STEPS", "SAMPLES", "LOSS", "SAMPLES/S", "CLOCK",
            "STALENESS", "MAX STALENESS", "NON-FINITE", "JOINED", "LAST SEEN"]
    reasons = [f"{t.name} (rank {t.rank}) evicted: {t.reason}" for t in trainers if t.reason]
    return "\n".join([f"TRAINERS    {summary}", *table(head, rows, numeric=(0, 6, 7, 8, 9, 10, 11, 12, 13)),
                      *_transports(trainers), *_received(trainers), *reasons])


def _transports(trainers: Sequence[pb.Trainer]) -> list[str]:
    """One line per path the trainers' buffers take, and why: a slow fallback is never silent."""
    ranks: dict[tuple[str, str], list[int]] = {}
    for t in trainers:
        if t.transport and enum_name(pb.TrainerState, t.state) == "ACTIVE":
            ranks.setdefault((t.transport, t.transport_reason), []).append(t.rank)
    return [f"transport   {kind} for rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, sorted(rs)))}: {reason}"
            for (kind, reason), rs in ranks.items()]


def _received(trainers: Sequence[pb.Trainer]) -> list[str]:
    """DiLoCo: what each trainer's syncs brought, in all and per sync."""
    return [f"received    rank {t.rank}: {human_bytes(t.received_bytes)} in {t.updates:,} syncs "
            f"({human_bytes(t.received_bytes // max(1, t.updates))} a sync)"
            for t in trainers if t.received_bytes and enum_name(pb.TrainerState, t.state) == "ACTIVE"]


def _progress(t: pb.Trainer) -> list[str]:
    """CLOCK, STALENESS and MAX STALENESS: "-" for a trainer with no step on a parameter server
    (collective ranks, a trainer that just joined)."""
    if t.clock == 0 and t.max_staleness == 0:
        return ["-", "-", "-"]
    return [f"{t.clock:,}", f"{t.staleness:,}", f"{t.max_staleness:,}"]
