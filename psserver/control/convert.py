"""Telemetry snapshots -> protobuf messages, and messages -> JSON-ready dicts.

Kept apart from the service so the mapping (enum names, absent values, NaN) is written once
and tested once; ``psserver status --json`` prints exactly what :func:`status_to_dict` and
:func:`trainer_to_dict` return. Server processes and embedding tables also convert back to the
dataclasses (:func:`server_process_from_proto`, :func:`table_from_proto`), for clients that work
on telemetry snapshots.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

from psserver.control.v1 import control_pb2 as pb
from psserver.telemetry import (
    CheckpointInfo,
    ServerProcessStatus,
    ServerStatus,
    ShardStatus,
    TableStatus,
    TrainerStatus,
)

log = logging.getLogger(__name__)

_MODE_NAMES = {"ps": "MODE_PS", "ddp": "MODE_DDP", "fsdp": "MODE_FSDP"}
_UPDATE_NAMES = {"async": "UPDATE_MODE_ASYNC", "sync": "UPDATE_MODE_SYNC", "ssp": "UPDATE_MODE_SSP",
                 "diloco": "UPDATE_MODE_DILOCO",
                 "collective": "UPDATE_MODE_COLLECTIVE"}


def _enum(enum: Any, name: str) -> int:
    """Enum value by full name, UNSPECIFIED (0) for anything the proto does not know."""
    try:
        return enum.Value(name)
    except ValueError:
        log.debug("unknown %s value %r", enum.DESCRIPTOR.name, name)
        return 0


def enum_name(enum: Any, value: int) -> str:
    """``SERVER_STATE_SERVING`` -> ``SERVING``; an unknown number -> ``UNKNOWN(7)``."""
    try:
        full = enum.Name(value)
    except ValueError:
        return f"UNKNOWN({value})"
    prefix = _prefix(enum)
    return full[len(prefix):] if full.startswith(prefix) else full


def _prefix(enum: Any) -> str:
    """Common prefix of an enum's value names (``SERVER_STATE_``), from its UNSPECIFIED value."""
    return enum.Name(0)[: -len("UNSPECIFIED")]


def _finite(x: float) -> bool:
    return x is not None and math.isfinite(x)


def checkpoint_to_proto(info: CheckpointInfo) -> pb.CheckpointInfo:
    return pb.CheckpointInfo(path=str(info.path), step=int(info.step), time=float(info.time))


def shard_to_proto(shard: ShardStatus) -> pb.Shard:
    return pb.Shard(
        index=int(shard.index),
        device=str(shard.device),
        num_params=int(shard.num_params),
        bytes=int(shard.bytes),
        state_bytes=int(shard.state_bytes),
    )


def server_process_to_proto(server: ServerProcessStatus) -> pb.ServerProcess:
    msg = pb.ServerProcess(
        rank=int(server.rank),
        name=server.name,
        host=server.host,
        state=_enum(pb.ServerProcessState, f"SERVER_PROCESS_STATE_{server.state.upper()}"),
        num_params=int(server.parameters),
        bytes=int(server.parameter_bytes),
        updates_applied=int(server.updates_applied),
    )
    if _finite(server.last_seen_s):
        msg.last_seen_age_seconds = max(0.0, float(server.last_seen_s))
    return msg


def server_process_from_proto(msg: pb.ServerProcess) -> ServerProcessStatus:
    """The inverse of :func:`server_process_to_proto` (an unknown state reads ``UNSPECIFIED``)."""
    return ServerProcessStatus(
        rank=msg.rank,
        name=msg.name,
        host=msg.host,
        state=enum_name(pb.ServerProcessState, msg.state),
        parameters=msg.num_params,
        parameter_bytes=msg.bytes,
        updates_applied=msg.updates_applied,
        last_seen_s=msg.last_seen_age_seconds if msg.HasField("last_seen_age_seconds") else float("nan"),
    )


def _rate(x: float) -> float:
    return float(x) if _finite(x) else 0.0


def table_to_proto(t: TableStatus) -> pb.EmbeddingTable:
    return pb.EmbeddingTable(
        table=t.table,
        server_rank=int(t.server_rank),
        rows=int(t.rows),
        max_rows=int(t.max_rows),
        dim=int(t.dim),
        bytes=int(t.bytes),
        admissions=int(t.admissions),
        refused=int(t.refused),
        evictions=int(t.evictions),
        expirations=int(t.expirations),
        lookups=int(t.lookups),
        updates=int(t.updates),
        lookups_per_second=_rate(t.lookups_per_s),
        updates_per_second=_rate(t.updates_per_s),
    )


def table_from_proto(msg: pb.EmbeddingTable) -> TableStatus:
    """The inverse of :func:`table_to_proto`."""
    return TableStatus(
        table=msg.table,
        server_rank=msg.server_rank,
        rows=msg.rows,
        max_rows=msg.max_rows,
        dim=msg.dim,
        bytes=msg.bytes,
        admissions=msg.admissions,
        refused=msg.refused,
        evictions=msg.evictions,
        expirations=msg.expirations,
        lookups=msg.lookups,
        updates=msg.updates,
        lookups_per_s=msg.lookups_per_second,
        updates_per_s=msg.updates_per_second,
    )


def status_to_proto(status: ServerStatus, now: float | None = None) -> pb.ServerStatus:
    now = time.time() if now is None else now
    msg = pb.ServerStatus(
        version=status.version,
        state=_enum(pb.ServerState, f"SERVER_STATE_{status.state.upper()}"),
        mode=_enum(pb.Mode, _MODE_NAMES.get(status.mode.lower(), "")),
        started_at=float(status.started_at),
        uptime_seconds=max(0.0, now - float(status.started_at)),
        model=status.model,
        num_params=int(status.num_params),
        update_mode=_enum(pb.UpdateMode, _UPDATE_NAMES.get(status.update_mode.lower(), "")),
        sync_trainers=int(status.sync_trainers),
        global_step=int(status.global_step),
        samples_seen=int(status.samples_seen),
        updates_per_second=float(status.updates_per_s) if _finite(status.updates_per_s) else 0.0,
        samples_per_second=float(status.samples_per_s) if _finite(status.samples_per_s) else 0.0,
        shards=[shard_to_proto(s) for s in status.shards],
        server_time=now,
        staleness=int(status.staleness),
        nonfinite_gradients=int(status.nonfinite_gradients),
        clipped_steps=int(status.clipped_steps),
        servers=[server_process_to_proto(s) for s in status.servers],
        tables=[table_to_proto(t) for t in status.tables],
    )
    if _finite(status.mean_loss):
        msg.mean_loss = float(status.mean_loss)
    if _finite(status.learning_rate):
        msg.learning_rate = float(status.learning_rate)
    msg.lr_schedule = status.lr_schedule
    msg.diloco = status.diloco
    msg.versions_copied = int(status.versions_copied)
    msg.weights_bytes_sent = int(status.weights_bytes_sent)
    msg.readers.extend(pb.WeightReader(name=r.name, peer=r.peer, step=int(r.step), read_at=float(r.read_at),
                                       age_seconds=float(r.age_s), reads=int(r.reads), sharing=int(r.sharing))
                       for r in status.readers)
    msg.memory_state = status.memory_state
    msg.stale_state.extend(pb.StaleState(path=x.path, bytes=int(x.bytes), run=x.run, pid=int(x.pid),
                                         started_at=float(x.started_at)) for x in status.stale_state)
    if status.last_checkpoint is not None:
        msg.last_checkpoint.CopyFrom(checkpoint_to_proto(status.last_checkpoint))
    return msg


def trainer_to_proto(t: TrainerStatus) -> pb.Trainer:
    msg = pb.Trainer(
        rank=int(t.rank),
        name=t.name,
        host=t.host,
        joined_at=float(t.joined_at),
        last_seen=float(t.last_seen),
        steps=int(t.steps),
        samples=int(t.samples),
        samples_per_second=float(t.samples_per_s) if _finite(t.samples_per_s) else 0.0,
        state=_enum(pb.TrainerState, f"TRAINER_STATE_{t.state.upper()}"),
        clock=int(t.clock),
        staleness=int(t.staleness),
        max_staleness=int(t.max_staleness),
        step=t.step,
        nonfinite=int(t.nonfinite),
        clipped=int(t.clipped),
        reason=t.reason,
        updates=int(t.updates),
        transport=t.transport,
        transport_reason=t.transport_reason,
        received_bytes=int(t.received_bytes),
    )
    if _finite(t.last_loss):
        msg.last_loss = float(t.last_loss)
    return msg


def trainers_to_proto(trainers: list[TrainerStatus], now: float | None = None) -> pb.ListTrainersResponse:
    ordered = sorted(trainers, key=lambda t: (t.rank, t.joined_at))
    return pb.ListTrainersResponse(
        trainers=[trainer_to_proto(t) for t in ordered], server_time=time.time() if now is None else now
    )


# ---- messages -> plain dicts (``--json``) ------------------------------------------------


def checkpoint_to_dict(info: pb.CheckpointInfo) -> dict[str, Any]:
    return {"path": info.path, "step": info.step, "time": info.time}


def server_process_to_dict(s: pb.ServerProcess) -> dict[str, Any]:
    return {
        "rank": s.rank,
        "name": s.name,
        "host": s.host,
        "state": enum_name(pb.ServerProcessState, s.state),
        "num_params": s.num_params,
        "bytes": s.bytes,
        "updates_applied": s.updates_applied,
        "last_seen_age_seconds": s.last_seen_age_seconds if s.HasField("last_seen_age_seconds") else None,
    }


def table_to_dict(t: pb.EmbeddingTable) -> dict[str, Any]:
    return {
        "table": t.table,
        "server_rank": t.server_rank,
        "rows": t.rows,
        "max_rows": t.max_rows,
        "dim": t.dim,
        "bytes": t.bytes,
        "admissions": t.admissions,
        "refused": t.refused,
        "evictions": t.evictions,
        "expirations": t.expirations,
        "lookups": t.lookups,
        "updates": t.updates,
        "lookups_per_second": t.lookups_per_second,
        "updates_per_second": t.updates_per_second,
    }


def status_to_dict(msg: pb.ServerStatus) -> dict[str, Any]:
    """Every field, enums by short name (``SERVING``), absent values as ``None``: valid JSON."""
    return {
        "version": msg.version,
        "state": enum_name(pb.ServerState, msg.state),
        "mode": enum_name(pb.Mode, msg.mode).lower(),
        "started_at": msg.started_at,
        "uptime_seconds": msg.uptime_seconds,
        "model": msg.model,
        "num_params": msg.num_params,
        "update_mode": enum_name(pb.UpdateMode, msg.update_mode).lower(),
        "sync_trainers": msg.sync_trainers,
        "staleness": msg.staleness,
        "nonfinite_gradients": msg.nonfinite_gradients,
        "clipped_steps": msg.clipped_steps,
        "global_step": msg.global_step,
        "samples_seen": msg.samples_seen,
        "updates_per_second": msg.updates_per_second,
        "samples_per_second": msg.samples_per_second,
        "mean_loss": msg.mean_loss if msg.HasField("mean_loss") else None,
        "learning_rate": msg.learning_rate if msg.HasField("learning_rate") else None,
        "lr_schedule": msg.lr_schedule,
        "diloco": msg.diloco,
        "versions_copied": msg.versions_copied,
        "weights_bytes_sent": msg.weights_bytes_sent,
        "readers": [{"name": r.name, "peer": r.peer, "step": r.step, "read_at": r.read_at,
                     "age_seconds": r.age_seconds, "reads": r.reads, "sharing": r.sharing} for r in msg.readers],
        "memory_state": msg.memory_state,
        "stale_state": [{"path": x.path, "bytes": x.bytes, "run": x.run, "pid": x.pid, "started_at": x.started_at}
                        for x in msg.stale_state],
        "shards": [
            {
                "index": s.index,
                "device": s.device,
                "num_params": s.num_params,
                "bytes": s.bytes,
                "state_bytes": s.state_bytes,
            }
            for s in msg.shards
        ],
        "last_checkpoint": checkpoint_to_dict(msg.last_checkpoint) if msg.HasField("last_checkpoint") else None,
        "servers": [server_process_to_dict(s) for s in msg.servers],
        "tables": [table_to_dict(t) for t in msg.tables],
        "server_time": msg.server_time,
    }


def trainer_to_dict(t: pb.Trainer) -> dict[str, Any]:
    return {
        "rank": t.rank,
        "name": t.name,
        "host": t.host,
        "joined_at": t.joined_at,
        "last_seen": t.last_seen,
        "steps": t.steps,
        "samples": t.samples,
        "last_loss": t.last_loss if t.HasField("last_loss") else None,
        "samples_per_second": t.samples_per_second,
        "state": enum_name(pb.TrainerState, t.state),
        "clock": t.clock,
        "staleness": t.staleness,
        "max_staleness": t.max_staleness,
        "step": t.step,
        "nonfinite": t.nonfinite,
        "clipped": t.clipped,
        "reason": t.reason,
        "updates": t.updates,
        "transport": t.transport,
        "transport_reason": t.transport_reason,
        "received_bytes": t.received_bytes,
    }
