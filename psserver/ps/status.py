"""The parameter server as the control plane and the metrics see it (a ``ControlTarget``).

Snapshots only: the control plane and the exporters read these, never the server's parts.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable

import psutil

from psserver import __version__
from psserver.config import ServerConfig
from psserver.ps.checkpointing import CheckpointPolicy
from psserver.ps.endpoint import Endpoint
from psserver.ps.engine import StepEngine
from psserver.ps.server_group import ServerGroup
from psserver.telemetry import CheckpointInfo, RateMeter, ServerStatus, ShardStatus, TrainerStatus


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
        """The other server processes, when there are several (``psserver.ps.server_group``)."""

    def on_step(self, step: int, samples: int) -> None:  # noqa: ARG002 - a StepEngine listener
        membership = self.endpoint.membership
        self.meter.add(samples, membership.mean_loss() if membership is not None else None)

    def get_status(self) -> ServerStatus:
        cfg, engine = self.config, self.engine
        ups, sps, loss = self.meter.rates()
        return ServerStatus(
            version=__version__,
            state=self.endpoint.state,
            mode="ps",
            started_at=self.started_at,
            model=cfg.model,
            num_params=engine.model_params,
            update_mode=cfg.update,
            sync_trainers=cfg.sync_trainers if cfg.update == "sync" else 0,
            staleness=cfg.staleness if cfg.update == "ssp" else 0,
            nonfinite_gradients=engine.guard.nonfinite_total,
            clipped_steps=engine.guard.clipped_total,
            global_step=engine.global_step,
            samples_seen=engine.samples_seen,
            updates_per_s=ups,
            samples_per_s=sps,
            mean_loss=loss,
            shards=[ShardStatus(s.index, str(s.device), s.num_params, s.num_bytes,
                                s.device_memory() or psutil.Process().memory_info().rss) for s in engine.shards],
            last_checkpoint=self.policy.last,
            accuracy=self._latest_accuracy(),
            servers=self.group.statuses() if self.group is not None else [],
        )

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
            out.append(status if p is None else dataclasses.replace(
                status, clock=p.clock, staleness=p.staleness, max_staleness=p.max_staleness, updates=p.updates))
        return out

    def checkpoint_now(self) -> CheckpointInfo:
        return self.policy.save(wait=True)

    def request_shutdown(self, reason: str = "shutdown requested") -> None:
        self._shutdown(reason)
