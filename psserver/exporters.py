"""Prometheus metrics and TensorBoard event files of a running server.

``start_exporters(target, obs)`` starts what ``ObservabilityConfig`` asks for and returns an
:class:`Exporters` whose ``close()`` stops it all. Both exporters only read the
:class:`psserver.telemetry.ControlTarget` snapshots (``get_status()``, ``list_trainers()``),
so the parameter server and collective rank 0 share them (server processes i > 0 of
``--num-servers`` serve only their process metrics and RPC times:
:func:`start_server_process_exporter`):

- Prometheus: a private :class:`CollectorRegistry` (several servers can run in one process,
  as tests do) served over HTTP by one thread with a cap on connections
  (``psserver.utils.metrics_http``); a custom collector reads the snapshots at scrape time, so no
  polling thread is needed. The only pushed metric is the RPC handling-time histogram, fed by
  :func:`observe_rpc` or the :func:`rpc_timed` decorator.
- TensorBoard: a background thread writes scalars from the snapshot every few seconds with
  torch's ``SummaryWriter`` (global step on the x axis); the ``tensorboard`` package is
  imported only when ``--tensorboard-dir`` is given.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from psserver.config import ObservabilityConfig
from psserver.errors import UsageError
from psserver.telemetry import (
    AGE_BUCKETS,
    CONTROL_REFUSALS,
    RPC_REFUSALS,
    SERVER_STATES,
    ControlTarget,
    ServerStatus,
    TrainerStatus,
)
from psserver.utils.metrics_http import MetricsHTTPServer

log = logging.getLogger(__name__)

PREFIX = "psserver"
RPC_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Buckets of the RPC histogram: a loopback round trip is ~0.5 ms, a sync barrier seconds."""
TENSORBOARD_INTERVAL_S = 5.0

F = TypeVar("F", bound=Callable[..., Any])

_active: list[Exporters] = []
_active_lock = threading.Lock()


# ---- RPC latency -----------------------------------------------------------------------


def observe_rpc(method: str, seconds: float) -> None:
    """Record that the server spent ``seconds`` handling one ``method`` RPC (no-op when no
    exporter runs in this process)."""
    for exporters in _active:  # copy-on-write list: no lock on the hot path
        exporters.observe_rpc(method, seconds)


def rpc_timed(method: str) -> Callable[[F], F]:
    """Decorator: time every call of an RPC handler into ``psserver_rpc_duration_seconds``."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not _active:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                observe_rpc(method, time.perf_counter() - t0)

        return timed  # type: ignore[return-value]

    return wrap


# ---- Prometheus ------------------------------------------------------------------------


def _finite(value: float) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _trainers_by_name(trainers: Iterable[TrainerStatus]) -> list[TrainerStatus]:
    """One entry per (rank, name): later entries (current members) win over history."""
    latest: dict[tuple[int, str], TrainerStatus] = {}
    for t in trainers:
        latest[(t.rank, t.name)] = t
    return list(latest.values())


class StatusCollector(Collector):
    """Turns the target's snapshots into Prometheus metrics at scrape time."""

    def __init__(self, target: ControlTarget) -> None:
        self.target = target

    def describe(self) -> Iterable[Metric]:
        return []  # dynamic: do not call collect() at registration time

    def collect(self) -> Iterator[Metric]:
        try:
            status = self.target.get_status()
            trainers = _trainers_by_name(self.target.list_trainers())
        except Exception:  # noqa: BLE001 - a scrape must not take the server down
            log.exception("metrics: cannot read the server status")
            err = GaugeMetricFamily(f"{PREFIX}_scrape_error", "1 when the last scrape could not read the status")
            err.add_metric([], 1)
            yield err
            return
        yield from self._server_metrics(status)
        yield from self._server_process_metrics(status)
        yield from self._embedding_metrics(status)
        refusals = CounterMetricFamily(f"{PREFIX}_control_refusals",
                                       "Control-plane calls refused (bad or missing token, admin calls without auth)",
                                       labels=["code"])
        for code, n in sorted(CONTROL_REFUSALS.counts().items()):
            refusals.add_metric([code], n)
        yield refusals
        rpc_refusals = CounterMetricFamily(f"{PREFIX}_rpc_refusals",
                                           "RPC messages refused (nothing of them ran) because they named a global "
                                           "outside psserver's RPC surface, by that name (cut to 100 characters; "
                                           "past 50 names, the rest under 'other')", labels=["name"])
        for name, n in sorted(RPC_REFUSALS.counts().items()):
            rpc_refusals.add_metric([name], n)
        yield rpc_refusals
        yield from self._trainer_metrics(trainers)
        yield from self._checkpoint_metrics(status)
        yield from self._reader_metrics(status)

    def _reader_metrics(self, s: ServerStatus) -> Iterator[Metric]:
        """Readers of the weights: how many, and how fresh each version was when one had it."""
        if s.reader_ages is None:
            return
        yield _gauge("readers", "Readers of the weights seen in the last 10 minutes", len(s.readers))
        yield _counter("versions_copied", "Versions of the model copied for readers (one copy under the update "
                       "lock each, however many read it)", s.versions_copied)
        yield _counter("weights_sent_bytes", "Bytes of versions sent to readers", s.weights_bytes_sent)
        ages = s.reader_ages
        age = HistogramMetricFamily(f"{PREFIX}_reader_version_age_seconds",
                                    "How old each version a reader read was when it had all of it: the read's end "
                                    "minus the time the server applied its step")
        age.add_metric([], [(str(b), c) for b, c in zip(AGE_BUCKETS, ages.counts, strict=True)] +
                       [("+Inf", ages.count)], sum_value=ages.total)
        yield age

    def _server_metrics(self, s: ServerStatus) -> Iterator[Metric]:
        info = GaugeMetricFamily(f"{PREFIX}_info", "Static facts about this server (value is always 1)",
                                 labels=["version", "mode", "model", "update_mode"])
        info.add_metric([s.version, s.mode, s.model, s.update_mode], 1)
        yield info
        state = GaugeMetricFamily(f"{PREFIX}_state", "1 for the server's current state", labels=["state"])
        for name in SERVER_STATES:  # WAITING included: a job that lost a server process waits for it
            state.add_metric([name], 1 if s.state == name else 0)
        yield state
        yield _gauge("up", "1 while the server is SERVING", 1 if s.state == "SERVING" else 0)
        yield _gauge("start_time_seconds", "Unix time the server started", s.started_at)
        yield _gauge("uptime_seconds", "Seconds since the server started", s.uptime_s)
        yield _gauge("parameters", "Number of model parameters", s.num_params)
        yield _gauge("sync_trainers", "K of --update sync (0 in async mode)", s.sync_trainers)
        yield _gauge("staleness_bound", "S of --update ssp: steps a trainer may run ahead of the slowest "
                     "(0 in other modes)", s.staleness)
        yield _counter("steps", "Optimizer steps applied (global step)", s.global_step)
        yield _counter("samples", "Training samples whose gradients were applied", s.samples_seen)
        yield _counter("nonfinite_gradients", "Gradients dropped (never applied) because their norm was NaN or inf",
                       s.nonfinite_gradients)
        yield _counter("clipped_steps", "Trainer steps scaled down to --max-grad-norm", s.clipped_steps)
        yield _gauge("updates_per_second", "Optimizer steps per second over the last window", s.updates_per_s)
        yield _gauge("samples_per_second", "Samples per second over the last window", s.samples_per_s)
        yield _gauge("loss", "Mean training loss reported over the last window (NaN when idle)", s.mean_loss)
        accuracy = getattr(s, "accuracy", None)
        if accuracy is not None and _finite(accuracy):
            yield _gauge("accuracy", "Last evaluation accuracy", accuracy)
        lr = getattr(s, "learning_rate", None)
        if lr is not None and _finite(lr):
            yield _gauge("learning_rate", "Learning rate of the server's next optimizer update (--lr-schedule)", lr)
        shard_bytes = GaugeMetricFamily(f"{PREFIX}_shard_bytes", "Bytes of parameters per model shard",
                                        labels=["shard", "device"])
        shard_mem = GaugeMetricFamily(f"{PREFIX}_shard_state_bytes",
                                      "Bytes of parameters and optimizer state per model shard (0: not known)",
                                      labels=["shard", "device"])
        for sh in s.shards:
            shard_bytes.add_metric([str(sh.index), sh.device], sh.bytes)
            shard_mem.add_metric([str(sh.index), sh.device], sh.state_bytes)
        yield shard_bytes
        yield shard_mem

    def _server_process_metrics(self, s: ServerStatus) -> Iterator[Metric]:
        """One sample per server process (none for a one-process server), labelled by rank only:
        names and hosts change when a process is replaced, the rank bounds the label sets. A
        process that leaves the snapshot leaves the scrape (the families are rebuilt each time)."""
        labels = ["server"]
        up = GaugeMetricFamily(f"{PREFIX}_server_process_up",
                               "1 while the server process is SERVING, 0 when lost or not registered yet",
                               labels=labels)
        size = GaugeMetricFamily(f"{PREFIX}_server_process_parameter_bytes",
                                 "Bytes of the parameters in the server process's partition", labels=labels)
        updates = GaugeMetricFamily(f"{PREFIX}_server_process_updates_applied",
                                    "Optimizer steps the server process applied to its partition", labels=labels)
        by_rank = {sp.rank: sp for sp in s.servers}  # one sample per label set, or the scrape fails
        for rank, sp in sorted(by_rank.items()):
            lv = [str(rank)]
            up.add_metric(lv, 1 if sp.state == "SERVING" else 0)
            size.add_metric(lv, sp.parameter_bytes)
            updates.add_metric(lv, sp.updates_applied)
        yield from (up, size, updates)

    def _embedding_metrics(self, s: ServerStatus) -> Iterator[Metric]:
        """One sample per embedding table per server process (none for a dense model), labelled
        by table and server rank. The counters are the tables' own (checkpoints keep them):
        lookups/s is ``rate(psserver_embedding_lookups_total[1m])``."""
        labels = ["table", "server"]
        families = [
            GaugeMetricFamily(f"{PREFIX}_embedding_rows",
                              "Rows of the embedding table on the server process (ids admitted, not evicted)",
                              labels=labels),
            GaugeMetricFamily(f"{PREFIX}_embedding_max_rows",
                              "Bound on the table's rows on the server process (--embedding-max-rows)", labels=labels),
            GaugeMetricFamily(f"{PREFIX}_embedding_bytes",
                              "Memory of the table's rows, optimizer state, index and admission sketch on the server "
                              "process", labels=labels),
            CounterMetricFamily(f"{PREFIX}_embedding_admissions", "Rows created (ids admitted) in the table",
                                labels=labels),
            CounterMetricFamily(f"{PREFIX}_embedding_refused",
                                "Lookups of ids not admitted yet (they read the shared default row)", labels=labels),
            CounterMetricFamily(f"{PREFIX}_embedding_evictions", "Rows evicted past the table's row bound",
                                labels=labels),
            CounterMetricFamily(f"{PREFIX}_embedding_expirations", "Rows evicted by the time-to-live", labels=labels),
            CounterMetricFamily(f"{PREFIX}_embedding_lookups", "Row lookups the table served", labels=labels),
            CounterMetricFamily(f"{PREFIX}_embedding_updates", "Row updates the table applied", labels=labels),
        ]
        fields = ("rows", "max_rows", "bytes", "admissions", "refused", "evictions", "expirations", "lookups",
                  "updates")
        by_key = {(t.server_rank, t.table): t for t in s.tables}  # one sample per label set, or the scrape fails
        for (rank, name), t in sorted(by_key.items()):
            for family, attr in zip(families, fields, strict=True):
                family.add_metric([name, str(rank)], getattr(t, attr))
        yield from families

    def _trainer_metrics(self, trainers: list[TrainerStatus]) -> Iterator[Metric]:
        now = time.time()
        labels = ["rank", "name"]
        up = GaugeMetricFamily(f"{PREFIX}_trainer_up", "1 while the trainer is active, 0 once it left or was lost",
                               labels=labels)
        state = GaugeMetricFamily(f"{PREFIX}_trainer_state", "1 for each trainer's current state",
                                  labels=[*labels, "state"])
        steps = CounterMetricFamily(f"{PREFIX}_trainer_steps", "Steps the trainer reported", labels=labels)
        samples = CounterMetricFamily(f"{PREFIX}_trainer_samples", "Samples the trainer reported", labels=labels)
        loss = GaugeMetricFamily(f"{PREFIX}_trainer_loss", "Last loss the trainer reported", labels=labels)
        rate = GaugeMetricFamily(f"{PREFIX}_trainer_samples_per_second", "Trainer's own throughput",
                                 labels=labels)
        seen = GaugeMetricFamily(f"{PREFIX}_trainer_last_seen_age_seconds",
                                 "Seconds since the trainer's last heartbeat or step", labels=labels)
        clock = GaugeMetricFamily(f"{PREFIX}_trainer_clock",
                                  "Steps the trainer started on the server (--update ssp bounds their spread)",
                                  labels=labels)
        staleness = GaugeMetricFamily(f"{PREFIX}_trainer_staleness",
                                      "Optimizer steps applied between the start of the trainer's latest step "
                                      "and its update", labels=labels)
        max_staleness = GaugeMetricFamily(f"{PREFIX}_trainer_max_staleness",
                                          "Largest staleness of any of the trainer's updates", labels=labels)
        updates = CounterMetricFamily(f"{PREFIX}_trainer_updates",
                                      "The trainer's gradients the server applied (sync: summed into a round)",
                                      labels=labels)
        nonfinite = CounterMetricFamily(f"{PREFIX}_trainer_nonfinite_gradients",
                                        "The trainer's gradients dropped because their norm was NaN or inf",
                                        labels=labels)
        clipped = CounterMetricFamily(f"{PREFIX}_trainer_clipped_steps",
                                      "The trainer's steps scaled down to --max-grad-norm", labels=labels)
        received = CounterMetricFamily(f"{PREFIX}_trainer_received_bytes",
                                       "Bytes of the trainer's pseudo-gradients the server received (--step diloco; "
                                       "per sync: over psserver_trainer_updates_total)", labels=labels)
        counts = {"ACTIVE": 0, "LEFT": 0, "LOST": 0}
        for t in trainers:
            lv = [str(t.rank), t.name]
            up.add_metric(lv, 1 if t.state == "ACTIVE" else 0)
            for st in counts:
                state.add_metric([*lv, st], 1 if t.state == st else 0)
            counts[t.state] = counts.get(t.state, 0) + 1
            steps.add_metric(lv, t.steps)
            samples.add_metric(lv, t.samples)
            loss.add_metric(lv, t.last_loss)
            rate.add_metric(lv, t.samples_per_s)
            seen.add_metric(lv, max(0.0, now - t.last_seen))
            clock.add_metric(lv, t.clock)
            staleness.add_metric(lv, t.staleness)
            max_staleness.add_metric(lv, t.max_staleness)
            updates.add_metric(lv, t.updates)
            nonfinite.add_metric(lv, t.nonfinite)
            clipped.add_metric(lv, t.clipped)
            received.add_metric(lv, t.received_bytes)
        total = GaugeMetricFamily(f"{PREFIX}_trainers", "Trainers by state (LEFT/LOST: recent history)",
                                  labels=["state"])
        for st, n in counts.items():
            total.add_metric([st], n)
        yield from (total, up, state, steps, samples, loss, rate, seen, clock, staleness, max_staleness, updates,
                    nonfinite, clipped, received)

    def _checkpoint_metrics(self, s: ServerStatus) -> Iterator[Metric]:
        # The schedule, so that an alert can compare the newest checkpoint's age with it (0: off).
        yield _gauge("checkpoint_interval_seconds", "Seconds between periodic checkpoints while steps are made "
                     "(--checkpoint-interval; 0: not by time, or no --checkpoint-dir)", s.checkpoint_interval_s)
        yield _gauge("checkpoint_every_steps", "Global steps between checkpoints (--checkpoint-every; 0: not by "
                     "step count, or no --checkpoint-dir)", s.checkpoint_every_steps)
        ck = s.last_checkpoint
        if ck is None:
            return
        yield _gauge("checkpoint_last_timestamp_seconds", "Unix time of the newest checkpoint", ck.time)
        yield _gauge("checkpoint_age_seconds", "Seconds since the newest checkpoint was written",
                     max(0.0, time.time() - ck.time))
        yield _gauge("checkpoint_last_step", "Global step of the newest checkpoint", ck.step)
        if _finite(ck.duration_s):
            yield _gauge("checkpoint_duration_seconds", "Seconds the newest checkpoint took to write", ck.duration_s)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=float(value))


class ServerRankCollector(Collector):
    """What a server process i > 0 exports besides its process metrics and RPC times: its rank
    (server 0 exports the job's state, these processes' liveness included)."""

    def __init__(self, server_rank: int) -> None:
        self.server_rank = server_rank

    def collect(self) -> Iterator[Metric]:
        yield _gauge("server_rank", "--server-rank of this server process (1..S-1; server 0 exports the job's "
                     "state)", self.server_rank)


def build_registry(target: ControlTarget | None, server_rank: int = 0) -> tuple[CollectorRegistry, Histogram]:
    """A private registry with the status collector (server 0, collective rank 0) or the rank of a
    server process i > 0 (``target`` None), process metrics and the RPC histogram."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StatusCollector(target) if target is not None else ServerRankCollector(server_rank))
    ProcessCollector(registry=registry)
    histogram = Histogram(
        f"{PREFIX}_rpc_duration_seconds",
        "Seconds the server spent handling one RPC from a trainer",
        labelnames=["method"],
        buckets=RPC_BUCKETS,
        registry=registry,
    )
    return registry, histogram


# ---- TensorBoard -----------------------------------------------------------------------


class TensorBoardWriter:
    """Writes loss, accuracy and throughput every ``interval_s`` seconds (x axis: global step)."""

    def __init__(self, target: ControlTarget, log_dir: Path, interval_s: float = TENSORBOARD_INTERVAL_S) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UsageError("install tensorboard for --tensorboard-dir (pip install tensorboard)") from None
        self.target = target
        self.interval_s = interval_s
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=max(1, int(interval_s)))
        self._last_step: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="psserver-tensorboard", daemon=True)
        self._thread.start()
        log.info("writing TensorBoard event files to %s", self.log_dir)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write_once()

    def write_once(self) -> bool:
        """Write one point of every scalar; skipped when the global step has not moved."""
        try:
            status = self.target.get_status()
            trainers = self.target.list_trainers()
        except Exception:  # noqa: BLE001
            log.debug("tensorboard: cannot read the status", exc_info=True)
            return False
        step = status.global_step
        if step == self._last_step:
            return False  # one point per global step
        self._last_step = step
        w = self.writer
        if _finite(status.mean_loss):
            w.add_scalar("loss/train", status.mean_loss, step)
        accuracy = getattr(status, "accuracy", None)
        if accuracy is not None and _finite(accuracy):
            w.add_scalar("accuracy/eval", accuracy, step)
        w.add_scalar("throughput/samples_per_s", status.samples_per_s, step)
        w.add_scalar("throughput/updates_per_s", status.updates_per_s, step)
        w.add_scalar("progress/samples_seen", status.samples_seen, step)
        lr = getattr(status, "learning_rate", None)
        if lr is not None and _finite(lr):
            w.add_scalar("optimizer/learning_rate", lr, step)
        w.add_scalar("trainers/active", sum(1 for t in trainers if t.state == "ACTIVE"), step)
        for t in trainers:
            t_acc = getattr(t, "accuracy", None)
            if t_acc is not None and _finite(t_acc):
                w.add_scalar(f"accuracy/rank{t.rank}", t_acc, step)
        w.flush()
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.write_once()
        self.writer.close()


# ---- both ------------------------------------------------------------------------------


class Exporters:
    """What :func:`start_exporters` started; ``close()`` stops all of it (idempotent)."""

    def __init__(self, target: ControlTarget | None, server_rank: int = 0) -> None:
        self.target = target
        self.registry, self._rpc_histogram = build_registry(target, server_rank)
        self.metrics_address: tuple[str, int] | None = None
        self._httpd: MetricsHTTPServer | None = None
        self.tensorboard: TensorBoardWriter | None = None
        self._closed = False

    @property
    def metrics_port(self) -> int | None:
        """The port actually bound (useful with ``--metrics-port 0``)."""
        return self.metrics_address[1] if self.metrics_address else None

    def observe_rpc(self, method: str, seconds: float) -> None:
        self._rpc_histogram.labels(method=method).observe(seconds)

    def start_http(self, host: str, port: int) -> None:
        try:
            self._httpd = MetricsHTTPServer(host, port, self.registry)
        except OSError as e:
            raise UsageError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from None
        self.metrics_address = (host, int(self._httpd.server_address[1]))
        log.info("Prometheus metrics on http://%s:%d/metrics", host, self.metrics_address[1])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _unregister(self)
        if self._httpd is not None:
            self._httpd.close()
        if self.tensorboard is not None:
            try:
                self.tensorboard.close()
            except Exception:  # noqa: BLE001 - closing must not mask the server's own exit
                log.exception("closing the TensorBoard writer failed")

    def __enter__(self) -> Exporters:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_exporters(
    target: ControlTarget,
    obs: ObservabilityConfig,
    *,
    tensorboard_interval_s: float = TENSORBOARD_INTERVAL_S,
) -> Exporters:
    """Start the Prometheus endpoint and/or the TensorBoard writer that ``obs`` asks for."""
    exporters = Exporters(target)
    try:
        if obs.metrics_port is not None:
            exporters.start_http(obs.metrics_host, obs.metrics_port)
        if obs.tensorboard_dir is not None:
            exporters.tensorboard = TensorBoardWriter(target, Path(obs.tensorboard_dir), tensorboard_interval_s)
    except BaseException:
        exporters.close()
        raise
    _register(exporters)
    return exporters


def start_server_process_exporter(obs: ObservabilityConfig, server_rank: int) -> Exporters | None:
    """Server process i > 0 of ``--num-servers``: with ``--metrics-port``, its process metrics, the
    times it spends in trainers' RPCs and its rank (no status of its own: server 0 exports the
    job's); None without ``--metrics-port``. Its ``--tensorboard-dir`` is server 0's business."""
    if obs.metrics_port is None:
        return None
    exporters = Exporters(None, server_rank)
    try:
        exporters.start_http(obs.metrics_host, obs.metrics_port)
    except BaseException:
        exporters.close()
        raise
    _register(exporters)
    return exporters


def serve_metrics(target: ControlTarget, obs: ObservabilityConfig) -> Exporters:
    """``start_exporters`` under the name collective rank 0 looks for (a context manager)."""
    return start_exporters(target, obs)


def _register(exporters: Exporters) -> None:
    global _active
    with _active_lock:
        _active = [*_active, exporters]  # copy on write: observe_rpc iterates without a lock


def _unregister(exporters: Exporters) -> None:
    global _active
    with _active_lock:
        _active = [e for e in _active if e is not exporters]
