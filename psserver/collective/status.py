"""What collective rank 0 tells the control plane: a ``ControlTarget`` over the training loop.

The gRPC threads only read snapshots and post requests; the training loop polls the
requests at its next sync point (every ``SYNC_EVERY`` steps, all ranks together), so a
checkpoint or a drain asked for over gRPC is carried out by every rank in step.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from contextlib import AbstractContextManager, nullcontext

import torch

from psserver import __version__
from psserver.config.control import ObservabilityConfig
from psserver.telemetry import CheckpointInfo, RateMeter, ServerStatus, ShardStatus, TrainerStatus

log = logging.getLogger(__name__)

SYNC_EVERY = 10
"""Steps between the all-gathers that share per-rank progress and control requests."""
# Layout of the per-rank row exchanged at each sync point.
ROW = ("steps", "samples", "loss", "samples_per_s", "checkpoint_requested", "stop_requested")


class CollectiveStatus:
    """The ``ControlTarget`` of collective rank 0 (see ``psserver.telemetry``)."""

    def __init__(self, mode: str, model: str, num_params: int, world_size: int, devices: list[str],
                 checkpoints_enabled: bool, checkpoint_every_steps: int = 0) -> None:
        self.ready = threading.Event()
        self.mode = mode
        self.model = model
        self.num_params = num_params
        self.world_size = world_size
        self.devices = devices
        self.checkpoints_enabled = checkpoints_enabled
        self.checkpoint_every_steps = checkpoint_every_steps if checkpoints_enabled else 0
        """``--checkpoint-every`` (0: only at the end, or no checkpoints): what the checkpoint
        alerts compare the last checkpoint's step with."""
        self.started_at = time.time()
        self.meter = RateMeter()
        self.state = "STARTING"
        self.global_step = 0
        self.samples_seen = 0
        self.last_checkpoint: CheckpointInfo | None = None
        self.last_loss = float("nan")
        """Loss of the latest step rank 0 has turned into a float."""
        self._lock = threading.Lock()
        self._host = socket.gethostname()
        now = time.time()
        self._ranks = [TrainerStatus(rank=r, name=f"rank{r}", host=self._host, joined_at=now, last_seen=now)
                       for r in range(world_size)]
        self._checkpoint_wanted = threading.Event()
        self._checkpoint_done = threading.Condition(self._lock)
        self._checkpoint_seq = 0
        self._stop_wanted = threading.Event()

    # -- called by the training loop -------------------------------------------------------
    def on_step(self, global_step: int, samples: int, loss: float) -> None:
        """One optimizer step of the whole job (``samples`` over all ranks)."""
        self.meter.add(samples, loss)
        with self._lock:
            self.global_step = global_step
            self.samples_seen += samples

    def on_sync(self, rows: torch.Tensor) -> None:
        """Per-rank rows (``ROW`` layout) gathered at a sync point."""
        now = time.time()
        with self._lock:
            for r, row in enumerate(rows.tolist()):
                t = self._ranks[r]
                t.steps, t.samples, t.last_loss, t.samples_per_s = int(row[0]), int(row[1]), row[2], row[3]
                t.last_seen = now

    def requests(self) -> tuple[bool, bool]:
        """(checkpoint wanted, stop wanted): rank 0's half of the next sync row."""
        return self._checkpoint_wanted.is_set(), self._stop_wanted.is_set()

    def on_checkpoint(self, info: CheckpointInfo) -> None:
        with self._lock:
            self.last_checkpoint = info
            self._checkpoint_seq += 1
            self._checkpoint_wanted.clear()
            self._checkpoint_done.notify_all()

    def set_state(self, state: str) -> None:
        with self._lock:
            self.state = state
            if state in ("DRAINING", "STOPPED"):
                for t in self._ranks:
                    t.state = "LEFT" if state == "STOPPED" else t.state
            self._checkpoint_done.notify_all()

    # -- ControlTarget -----------------------------------------------------------------------
    def get_status(self) -> ServerStatus:
        updates, samples, loss = self.meter.rates()
        if loss != loss:  # the meter gets no losses (they are read in batches): use the latest
            loss = self.last_loss
        with self._lock:
            shards = [ShardStatus(index=i, device=dev, num_params=self.num_params // max(1, len(self.devices)),
                                  bytes=4 * self.num_params // max(1, len(self.devices)),
                                  state_bytes=0)  # the optimizer is the training loop's: not known here
                      for i, dev in enumerate(self.devices)]
            return ServerStatus(
                version=__version__, state=self.state, mode=self.mode, started_at=self.started_at,
                model=self.model, num_params=self.num_params, update_mode="collective",
                sync_trainers=self.world_size, global_step=self.global_step, samples_seen=self.samples_seen,
                updates_per_s=updates, samples_per_s=samples, mean_loss=loss, shards=shards,
                last_checkpoint=self.last_checkpoint, checkpoint_every_steps=self.checkpoint_every_steps,
            )

    def list_trainers(self) -> list[TrainerStatus]:
        with self._lock:
            return [TrainerStatus(**vars(t)) for t in self._ranks]

    def checkpoint_now(self, timeout: float = 600.0) -> CheckpointInfo:
        if not self.checkpoints_enabled:
            raise RuntimeError("checkpoints are not configured (start training with --checkpoint-dir)")
        with self._lock:
            if self.state not in ("SERVING", "STARTING"):
                raise RuntimeError(f"training is {self.state.lower()}, no checkpoint possible")
            seq = self._checkpoint_seq
            self._checkpoint_wanted.set()
            ok = self._checkpoint_done.wait_for(
                lambda: self._checkpoint_seq > seq or self.state not in ("SERVING", "STARTING"), timeout)
            if not ok or self._checkpoint_seq == seq:
                raise RuntimeError("training ended before the checkpoint was taken")
            assert self.last_checkpoint is not None
            return self.last_checkpoint

    def request_shutdown(self) -> None:
        log.warning("shutdown requested over the control plane: draining at the next sync point")
        self._stop_wanted.set()
        with self._lock:
            if self.state in ("STARTING", "SERVING"):
                self.state = "DRAINING"


def control_server(target: CollectiveStatus, control) -> AbstractContextManager:
    """``psserver.control.server.ControlServer`` around rank 0's training.

    When it cannot start (its port is taken, say), training goes on without it (logged),
    since a training run should not die for its status endpoint.
    """
    if not control.enabled:
        return nullcontext()
    from psserver.control.server import ControlServer

    return _Tolerant(ControlServer(target, control))


class _Tolerant(AbstractContextManager):
    """Enter a context manager, or log why not and carry on."""

    def __init__(self, inner: AbstractContextManager) -> None:
        self.inner = inner
        self.entered = False

    def __enter__(self):
        try:
            value = self.inner.__enter__()
        except Exception as e:  # noqa: BLE001 - port taken, TLS files unreadable, ...
            log.warning("control plane not started: %s", str(e).splitlines()[0] if str(e) else type(e).__name__)
            return None
        self.entered = True
        return value

    def __exit__(self, *exc):
        if self.entered:
            return self.inner.__exit__(*exc)
        return False


def metrics_endpoint(target: CollectiveStatus, observability: ObservabilityConfig) -> AbstractContextManager:
    """Prometheus (``--metrics-port``) and TensorBoard (``--tensorboard-dir``) on rank 0,
    read from the same status snapshots the control plane serves."""
    if observability.metrics_port is None and observability.tensorboard_dir is None:
        return nullcontext()
    from psserver.exporters import serve_metrics

    return serve_metrics(target, observability)
