"""A small but real ControlTarget: real snapshots, a real background "training" thread."""

from __future__ import annotations

import math
import threading
import time
from pathlib import Path

import torch
from torch import nn

from psserver.config.control import ControlConfig
from psserver.control.server import ControlServer
from psserver.server.versions import Versions
from psserver.telemetry import (
    CheckpointInfo,
    RateMeter,
    ReaderStatus,
    ServerProcessStatus,
    ServerStatus,
    ShardStatus,
    TableStatus,
    TrainerStatus,
)

TOKEN = "s3cret-token"


def two_servers() -> list[ServerProcessStatus]:
    """Server 0 and a lost server 1 of a ``--num-servers 2`` job: 3/4 and 1/4 of the bytes."""
    return [
        ServerProcessStatus(rank=0, name="ps_0", host="hostA", state="SERVING", parameters=3000,
                            parameter_bytes=12000, updates_applied=40, last_seen_s=0.0),
        ServerProcessStatus(rank=1, name="ps_1", host="hostB", state="LOST", parameters=1000,
                            parameter_bytes=4000, updates_applied=38, last_seen_s=75.0),
    ]


def two_tables() -> list[TableStatus]:
    """Table ``users`` on servers 0 and 1 (server 1's at its bound, evicting) and ``items`` on server 0."""
    return [
        TableStatus(table="users", server_rank=0, rows=1500, max_rows=2000, dim=16, bytes=3 << 20, admissions=1600,
                    refused=250, evictions=0, expirations=100, lookups=90000, updates=85000, lookups_per_s=1234.5,
                    updates_per_s=1200.5),
        TableStatus(table="items", server_rank=0, rows=40, max_rows=2000, dim=8, bytes=4096, admissions=40, refused=7,
                    evictions=0, expirations=0, lookups=9000, updates=8800, lookups_per_s=0.0, updates_per_s=0.0),
        TableStatus(table="users", server_rank=1, rows=2000, max_rows=2000, dim=16, bytes=4 << 20, admissions=2600,
                    refused=300, evictions=600, expirations=0, lookups=95000, updates=90000, lookups_per_s=1300.0,
                    updates_per_s=1250.0),
    ]


class FakeTarget:
    """Implements psserver.telemetry.ControlTarget with a background "training" thread."""

    def __init__(self, checkpoint_dir: Path | None = None, ready: bool = True) -> None:
        self.ready = threading.Event()
        if ready:
            self.ready.set()
        self.state = "SERVING" if ready else "STARTING"
        self.started_at = time.time() - 125.0
        self.checkpoint_dir = checkpoint_dir
        self.global_step = 0
        self.samples = 0
        self.meter = RateMeter(window=5.0)
        self.shutdown_requested = threading.Event()
        self.checkpoints: list[CheckpointInfo] = []
        self.update_mode, self.sync_trainers, self.staleness = "sync", 2, 0
        self.servers: list[ServerProcessStatus] = []  # one process; see two_servers()
        self.tables: list[TableStatus] = []  # a dense model; see two_tables()
        self.readers: list[ReaderStatus] = []  # readers of the weights
        self.learning_rate, self.lr_schedule = math.nan, ""  # the optimizer not known yet
        self._lock = threading.Lock()
        now = time.time()
        self.trainers = [
            TrainerStatus(rank=0, name="trainer_0_0", host="hostA", joined_at=now - 60, last_seen=now,
                          steps=10, samples=640, last_loss=0.5, samples_per_s=100.0, clock=11, staleness=2,
                          max_staleness=5, step="pushpull", transport="staged",
                          transport_reason="the server is on another host, so through pinned host memory"),
            TrainerStatus(rank=1, name="trainer_1_0", host="hostB", joined_at=now - 50, last_seen=now - 20,
                          steps=3, samples=192, state="LOST", nonfinite=3,
                          reason="sent 3 non-finite gradients in a row (--max-nonfinite-steps 3)"),
        ]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._train, daemon=True)
        self._thread.start()

    def _train(self) -> None:
        while not self._stop.wait(0.02):
            with self._lock:
                self.global_step += 1
                self.samples += 64
            self.meter.add(64, loss=1.0 / (1 + self.global_step))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def get_status(self) -> ServerStatus:
        ups, sps, loss = self.meter.rates()
        with self._lock:
            step, samples = self.global_step, self.samples
        return ServerStatus(
            version="0.1.0", state=self.state, mode="ps", started_at=self.started_at, model="mlp",
            num_params=1234, update_mode=self.update_mode, sync_trainers=self.sync_trainers, global_step=step,
            samples_seen=samples, updates_per_s=ups, samples_per_s=sps, mean_loss=loss, staleness=self.staleness,
            shards=[ShardStatus(0, "cpu", 1000, 4000, 12016), ShardStatus(1, "cpu", 234, 936, 0)],
            last_checkpoint=self.checkpoints[-1] if self.checkpoints else None, servers=list(self.servers),
            tables=list(self.tables), learning_rate=self.learning_rate, lr_schedule=self.lr_schedule,
            readers=list(self.readers),
        )

    def list_trainers(self) -> list[TrainerStatus]:
        return list(self.trainers)

    def checkpoint_now(self) -> CheckpointInfo:
        if self.checkpoint_dir is None:
            raise RuntimeError("checkpoints are not configured (--checkpoint-dir)")
        with self._lock:
            step = self.global_step
        path = self.checkpoint_dir / f"ckpt-{step:08d}.pt"
        path.write_bytes(b"fake")
        info = CheckpointInfo(str(path), step, time.time())
        self.checkpoints.append(info)
        return info

    def request_shutdown(self) -> None:
        self.shutdown_requested.set()
        self.state = "DRAINING"


def serve(target: FakeTarget, **config) -> ControlServer:
    """A started ControlServer on a free loopback port; stop() it (or use ``with``)."""
    return ControlServer(target, ControlConfig(port=0, **config), grace=0.5).start()


class Trained:
    """A linear model whose every value is its global step, stepped by a thread under one lock
    (as the server's update lock): a read that mixes two steps cannot hide."""

    def __init__(self) -> None:
        self.model = nn.Linear(300, 200)
        self.model.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.lock = threading.Lock()
        self.step = 0
        self.table = torch.arange(40, dtype=torch.float32).reshape(10, 4)  # row i: 4i .. 4i+3
        self.versions = Versions(self.copy, lambda: self.step, 0.0, lambda: "linear", self.rows)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def copy(self):
        with self.lock:
            return self.step, {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def rows(self, table: str, ids: torch.Tensor) -> tuple[int, torch.Tensor]:
        if table != "users":
            raise ValueError(f"no embedding table {table!r} (tables: users)")
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError("ids of table 'users' must be unique in a request")
        return self.step, self.table[ids.clamp(max=9)]

    def train_one(self) -> None:
        with self.lock, torch.no_grad():
            self.step += 1
            for t in self.model.state_dict().values():
                t.fill_(self.step)
        self.versions.on_step(self.step, 1)

    def start(self) -> None:
        def run():
            while not self._stop.wait(0.002):
                self.train_one()

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
