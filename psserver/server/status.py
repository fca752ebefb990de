"""The parameter server as the control plane and the metrics see it (a ``ControlTarget``).

Snapshots only: the control plane and the exporters read these, never the server's parts.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from psserver import __version__
from psserver.config import ServerConfig
from psserver.server.checkpoints.checkpointing import CheckpointPolicy
from psserver.server.endpoint import Endpoint
from psserver.server.engine.engine import StepEngine
from psserver.server.engine.shard import Shard
from psserver.server.group.server_group import ServerGroup
from psserver.server.state.memory import MemoryState
from psserver.server.versions import Versions
from psserver.telemetry import (
    CheckpointInfo,
    RateMeter,
    ServerStatus,
    ShardStatus,
    StaleStateStatus,
    TableStatus,
    TrainerStatus,
)


class TableRates:
    """Lookups/s and updates/s of every table on every server process, from successive reads of
    their counters: the tables only count (no clock on the hot path), and the counters of the
    other server processes arrive once a watch anyway. A rate spans from the newest kept read at
    least ``window`` s old (else the oldest) to now: about the last ``window`` s, and never less
    than ``min_span`` s (until then it reads 0). The reads kept are at least ``min_span`` s apart."""

    def __init__(self, window: float = 10.0, min_span: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self.min_span = min_span
        self.clock = clock
        self._lock = threading.Lock()  # the control plane and a metrics scrape read at once
        self._reads: dict[tuple[int, str], deque[tuple[float, int, int]]] = {}
        """(time, lookups, updates) reads per (server rank, table), at least ``min_span`` apart."""
        self._rates: dict[tuple[int, str], tuple[float, float]] = {}
        self._last = -float("inf")

    def due(self) -> bool:
        """Whether a read now would be kept (the last one is at least ``min_span`` old)."""
        return self.clock() - self._last >= self.min_span

    def observe(self, tables: list[TableStatus]) -> list[TableStatus]:
        """``tables`` with their rates; tables absent from this read are forgotten."""
        now = self.clock()
        out = []
        with self._lock:
            if now - self._last >= self.min_span:
                self._last = now
            seen = set()
            for t in tables:
                key = (t.server_rank, t.table)
                seen.add(key)
                lookups, updates = self._rate(key, now, t.lookups, t.updates)
                out.append(dataclasses.replace(t, lookups_per_s=lookups, updates_per_s=updates))
            for key in set(self._reads) - seen:
                del self._reads[key]
                self._rates.pop(key, None)
        return out

    def _rate(self, key: tuple[int, str], now: float, lookups: int, updates: int) -> tuple[float, float]:
        reads = self._reads.setdefault(key, deque())
        if reads and (lookups < reads[-1][1] or updates < reads[-1][2]):
            reads.clear()  # the counters went back: a restart, or every server went back to a checkpoint
            self._rates.pop(key, None)
        while len(reads) > 1 and now - reads[1][0] >= self.window:
            reads.popleft()  # the oldest read left is the newest one at least a window old
        if reads and now - reads[0][0] >= self.min_span:
            t0, l0, u0 = reads[0]
            self._rates[key] = ((lookups - l0) / (now - t0), (updates - u0) / (now - t0))
        if not reads or now - reads[-1][0] >= self.min_span:
            reads.append((now, lookups, updates))
        return self._rates.get(key, (0.0, 0.0))


def state_bytes(shard: Shard) -> int:
    """Bytes of ``shard``'s parameters and its optimizer's state (Adam's two moments and step
    counts, SGD's momentum buffers): what the shard itself holds on its device, unlike the
    process's memory (torch alone is hundreds of MB). Read without the shard's lock, so a
    status call never waits for an update: a state made in a step that runs now may be missed."""
    n = shard.num_bytes
    optimizer = shard.optimizer
    if optimizer is not None:
        for state in list(optimizer.state.values()):
            n += sum(v.numel() * v.element_size() for v in list(state.values()) if isinstance(v, torch.Tensor))
    return n


def _nan_if_none(x: float | None) -> float:
    return float("nan") if x is None else float(x)


class ServerView:
    """Implements :class:`psserver.telemetry.ControlTarget` for ``psserver serve``."""

    def __init__(self, config: ServerConfig, engine: StepEngine, endpoint: Endpoint, policy: CheckpointPolicy,
                 shutdown: Callable[[str], None]) -> None:
        self.config = config
        self.engine = engine
        self.endpoint = endpoint
        self.policy = policy
        self._shutdown = shutdown
        self.ready = threading.Event()
        self.started_at = time.time()
        self.meter = RateMeter(window=10.0)
        self.group: ServerGroup | None = None
        self.memory: MemoryState | None = None
        """The state in shared memory (``--state-dir``), for its line and the stale segments."""
        """The other server processes, when there are several (``psserver.server.group.server_group``)."""
        self.table_rates = TableRates(window=10.0)
        self.versions: Versions | None = None
        """The versions of the model readers read (``psserver.server.versions``)."""

    def on_step(self, step: int, samples: int) -> None:  # noqa: ARG002 - a StepEngine listener
        membership = self.endpoint.membership
        self.meter.add(samples, membership.mean_loss() if membership is not None else None)
        if self.engine.tables is not None and self.table_rates.due():
            self._tables()  # a read a second while training: a status call that comes alone has its rates

    def get_status(self) -> ServerStatus:
        cfg, engine = self.config, self.engine
        ups, sps, loss = self.meter.rates()
        interval_s, every_steps = self.checkpoint_schedule()
        return ServerStatus(
            version=__version__,
            state=self.endpoint.state,
            mode="ps",
            started_at=self.started_at,
            model=engine.model_ref or "(none yet: the first trainer brings it)",
            num_params=engine.model_params,
            update_mode=cfg.update,
            sync_trainers=cfg.sync_trainers if cfg.rounds else 0,
            staleness=cfg.staleness if cfg.update == "ssp" else 0,
            nonfinite_gradients=engine.guard.nonfinite_total,
            clipped_steps=engine.guard.clipped_total,
            global_step=engine.global_step,
            samples_seen=engine.samples_seen,
            updates_per_s=ups,
            samples_per_s=sps,
            mean_loss=loss,
            shards=[ShardStatus(s.index, str(s.device), s.num_params, s.num_bytes, state_bytes(s))
                    for s in engine.shards],
            last_checkpoint=self.policy.last,
            checkpoint_interval_s=interval_s,
            checkpoint_every_steps=every_steps,
            accuracy=self._latest_accuracy(),
            servers=self.group.statuses() if self.group is not None else [],
            tables=self._tables(),
            learning_rate=_nan_if_none(engine.learning_rate),
            lr_schedule=cfg.lr_schedule.describe(),
            diloco=self._diloco(),
            readers=self.versions.readers() if self.versions is not None else [],
            reader_ages=self.versions.age_histogram() if self.versions is not None else None,
            versions_copied=self.versions.copies if self.versions is not None else 0,
            weights_bytes_sent=self.versions.bytes_sent if self.versions is not None else 0,
            memory_state=self.memory.describe() if self.memory is not None else "",
            stale_state=[StaleStateStatus(str(x.path), x.nbytes, (x.owner or {}).get("run") or "",
                                          int((x.owner or {}).get("pid") or 0),
                                          float((x.owner or {}).get("started") or 0.0))
                         for x in self.memory.stale] if self.memory is not None else [],
        )

    def _diloco(self) -> str:
        """``--update diloco`` in one line (empty in other modes)."""
        cfg = self.config
        if cfg.update != "diloco":
            return ""
        rounds = f"outer sync, {cfg.sync_trainers} pseudo-gradients a round" if cfg.rounds else \
            "outer async, each pseudo-gradient on arrival"
        if cfg.dynamic_local_steps:
            rounds += ", dynamic local steps"
        optimizer = self.engine.optimizer_config
        return f"{rounds}; {optimizer.describe() if optimizer is not None else 'outer optimizer not known yet'}"

    def checkpoint_schedule(self) -> tuple[float, int]:
        """(``--checkpoint-interval``, ``--checkpoint-every``), both 0 without ``--checkpoint-dir``:
        what the metrics export so that an alert can tell a late checkpoint."""
        ck = self.config.checkpoint
        return (ck.interval_s, ck.every_steps) if ck.directory is not None else (0.0, 0)

    def _tables(self) -> list[TableStatus]:
        """This process's embedding tables, then those the other server processes last reported."""
        own = self.engine.tables
        tables = own.status() if own is not None else []
        if self.group is not None:
            tables += self.group.table_statuses()
        return self.table_rates.observe(tables)

    def _latest_accuracy(self) -> float:
        """The held-out accuracy the most recently seen trainer reported (NaN before any)."""
        measured = [t for t in self.list_trainers() if math.isfinite(t.accuracy)]
        return max(measured, key=lambda t: t.last_seen).accuracy if measured else float("nan")

    def list_trainers(self) -> list[TrainerStatus]:
        """Every trainer membership knows (live and recent history), each with its clock and
        staleness from the engine: copies, so a reader never sees a status change under it."""
        membership = self.endpoint.membership
        if membership is None:
            return []
        trainers = membership.snapshot()
        progress = self.engine.trainers_progress([t.name for t in trainers])  # clocks of one instant
        out = []
        guard = self.engine.guard
        for status in trainers:
            p = progress.get(status.name)  # None: joined a moment ago, or left long ago
            counts = guard.counts(status.name)
            status = dataclasses.replace(status, nonfinite=counts.nonfinite, clipped=counts.clipped)
            status = self._current_transport(status)
            out.append(status if p is None else dataclasses.replace(
                status, clock=p.clock, staleness=p.staleness, max_staleness=p.max_staleness, updates=p.updates,
                received_bytes=p.received_bytes))
        return out

    def _current_transport(self, status: TrainerStatus) -> TrainerStatus:
        """``status`` with the path its trainer's buffers take now: the join's, unless a probe of
        the device map failed since (``TrainerComputeServer.fall_back``). The membership keeps the
        join's for as long as it shows the trainer, the protocol's half only while it serves it."""
        half = self.endpoint.halves.get(status.step)
        kind, why = half.transport_of(status.name) if status.transport and hasattr(half, "transport_of") else ("", "")
        return dataclasses.replace(status, transport=kind, transport_reason=why) if kind else status

    def checkpoint_now(self) -> CheckpointInfo:
        return self.policy.save(wait=True)

    def request_shutdown(self, reason: str = "shutdown requested") -> None:
        self._shutdown(reason)
