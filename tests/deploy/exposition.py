"""What the server exports, for the checks of deploy/prometheus/ and deploy/grafana/.

``realistic_target()`` is a ControlTarget whose status has everything a real job can show at
once (several server processes, embedding tables, a checkpoint and its schedule, trainers in
every state, an accuracy and a learning rate), so that the collector emits every family;
``exported_names()`` the sample names of its exposition (plus ``psserver_scrape_error``, which
only a broken status produces), read from a real /metrics endpoint.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import urllib.request

from psserver.telemetry import (
    AgeHistogram,
    CheckpointInfo,
    ReaderStatus,
    ServerProcessStatus,
    ServerStatus,
    ShardStatus,
    TableStatus,
    TrainerStatus,
)

SUFFIXES = {"histogram": ("_bucket", "_count", "_sum", "_created"), "summary": ("_count", "_sum", "_created"),
            "counter": ("_created",)}
PROMETHEUS_OWN = {"up", "scrape_duration_seconds", "scrape_samples_scraped", "scrape_series_added",
                  "scrape_samples_post_metric_relabeling", "ALERTS", "ALERTS_FOR_STATE"}
"""Series Prometheus itself adds to every target (and to alerts)."""


class RealisticTarget:
    """A ControlTarget with a full status (its ``broken`` flag makes the status unreadable)."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.ready.set()
        self.broken = False

    def get_status(self) -> ServerStatus:
        if self.broken:
            raise RuntimeError("status unavailable")
        now = time.time()
        return ServerStatus(
            version="0.0.test", state="SERVING", mode="ps", started_at=now - 600, model="dlrm", num_params=10**6,
            update_mode="ssp", sync_trainers=0, staleness=4, global_step=1200, samples_seen=76800,
            updates_per_s=20.0, samples_per_s=1280.0, mean_loss=0.42, accuracy=0.91, learning_rate=0.01,
            nonfinite_gradients=2, clipped_steps=5,
            shards=[ShardStatus(0, "cpu", 10**6, 4 * 10**6, 1 << 28)],
            last_checkpoint=CheckpointInfo("/ck/ckpt-1000.pt", 1000, now - 40, duration_s=1.5),
            checkpoint_interval_s=60.0, checkpoint_every_steps=500,
            servers=[ServerProcessStatus(0, "ps_0", "a", "SERVING", 5 * 10**5, 2 * 10**6, 1200, last_seen_s=0.0),
                     ServerProcessStatus(1, "ps_1", "b", "LOST", 5 * 10**5, 2 * 10**6, 1100, last_seen_s=30.0)],
            tables=[TableStatus("users", 0, 1500, 2000, 16, 3 << 20, 1600, 250, 0, 100, 90000, 85000),
                    TableStatus("users", 1, 1400, 2000, 16, 3 << 20, 1500, 200, 10, 0, 80000, 75000)],
            readers=[ReaderStatus("rollout-0", "ipv4:10.0.0.7:40000", 1190, now - 1, 0.2, 300, sharing=8)],
            reader_ages=AgeHistogram(counts=[0, 0, 10, 100, 280, 300, 300, 300, 300, 300, 300, 300], count=300,
                                     total=45.0),
            versions_copied=310, weights_bytes_sent=310 * 4 * 10**6,
        )

    def list_trainers(self) -> list[TrainerStatus]:
        now = time.time()
        return [TrainerStatus(0, "trainer_0_1", "h", now - 500, now, steps=600, samples=38400, last_loss=0.4,
                              samples_per_s=640.0, clock=600, staleness=1, max_staleness=3, updates=600),
                TrainerStatus(1, "trainer_1_1", "h", now - 500, now - 100, state="LOST", nonfinite=2),
                TrainerStatus(2, "trainer_2_1", "h", now - 500, now - 50, state="LEFT", accuracy=0.91)]

    def checkpoint_now(self) -> CheckpointInfo:
        raise RuntimeError("no checkpoints here")

    def request_shutdown(self) -> None:
        pass


def realistic_target() -> RealisticTarget:
    return RealisticTarget()


def names_in(text: str) -> set[str]:
    """Sample names of a text exposition, empty families included (from their ``# TYPE`` line)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            names.add(name)
            names.update(name + s for s in SUFFIXES.get(kind, ()))
        elif line and not line.startswith("#"):
            m = re.match(r"[a-zA-Z_:][a-zA-Z0-9_:]*", line)
            if m:
                names.add(m.group(0))
    return names


def exported_names() -> set[str]:
    """Every sample name the server can export: a full status's and a broken status's exposition,
    each read over HTTP from the real exporter."""
    from psserver.config import ObservabilityConfig
    from psserver.exporters import start_exporters

    target = realistic_target()
    names: set[str] = set()
    quiet = logging.getLogger("psserver.exporters")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # the broken status logs its traceback: expected here
    try:
        with start_exporters(target, ObservabilityConfig(metrics_port=0)) as ex:
            for broken in (False, True):
                target.broken = broken
                with urllib.request.urlopen(f"http://127.0.0.1:{ex.metrics_port}/metrics", timeout=10) as r:
                    names |= names_in(r.read().decode())
    finally:
        quiet.setLevel(level)
    return names
