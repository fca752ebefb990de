"""Prometheus and TensorBoard exporters (psserver/exporters.py).

Unit tests drive a fake ControlTarget in-process; the multiprocess test scrapes a real
``psserver serve --metrics-port`` while a real trainer trains, then SIGKILLs the trainer and
waits for the eviction to show in the liveness gauge.
"""

from __future__ import annotations

import math
import signal
import socket
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from psserver.config import ObservabilityConfig
from psserver.errors import UsageError
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
from tests.procs import free_port, wait_until

# ---- helpers ---------------------------------------------------------------------------


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} from a /metrics endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, metric: str, /, **labels: str) -> float:
    key = (metric, tuple(sorted(labels.items())))
    assert key in samples, f"{metric}{labels} not scraped; have {sorted(k[0] for k in samples)}"
    return samples[key]


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


class FakeTarget:
    """A ControlTarget whose snapshot the test edits."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.ready.set()
        self.step = 0
        self.loss = 1.0
        self.trainers = [TrainerStatus(0, "trainer_0_1", "h", time.time(), time.time(), steps=3, samples=192,
                                       last_loss=0.5, samples_per_s=100.0, clock=4, staleness=1, max_staleness=3)]
        self.last_checkpoint: CheckpointInfo | None = None
        self.servers: list[ServerProcessStatus] = []
        self.tables: list[TableStatus] = []
        self.learning_rate = float("nan")
        self.state = "SERVING"
        self.checkpoint_interval_s = 0.0
        self.checkpoint_every_steps = 0
        self.readers: list[ReaderStatus] = []
        self.reader_ages: AgeHistogram | None = None

    def get_status(self) -> ServerStatus:
        return ServerStatus(
            version="0.0.test", state=self.state, mode="ps", started_at=time.time() - 10, model="mlp",
            num_params=1234, update_mode="async", sync_trainers=0, global_step=self.step,
            samples_seen=64 * self.step, updates_per_s=5.0, samples_per_s=320.0, mean_loss=self.loss,
            shards=[ShardStatus(0, "cpu", 1234, 4936, 1 << 20)], last_checkpoint=self.last_checkpoint,
            servers=list(self.servers), tables=list(self.tables), learning_rate=self.learning_rate,
            checkpoint_interval_s=self.checkpoint_interval_s, checkpoint_every_steps=self.checkpoint_every_steps,
            readers=list(self.readers), reader_ages=self.reader_ages,
        )

    def list_trainers(self) -> list[TrainerStatus]:
        return list(self.trainers)

    def checkpoint_now(self) -> CheckpointInfo:
        raise RuntimeError("no checkpoints")

    def request_shutdown(self) -> None:
        pass


# ---- unit tests ------------------------------------------------------------------------


def test_prometheus_endpoint_reads_status_at_scrape_time():
    from psserver.exporters import start_exporters

    target = FakeTarget()
    ex = start_exporters(target, ObservabilityConfig(metrics_port=0))
    try:
        port = ex.metrics_port
        assert port
        s1 = scrape(port)
        assert value(s1, "psserver_up") == 1
        assert value(s1, "psserver_steps_total") == 0
        assert value(s1, "psserver_info", version="0.0.test", mode="ps", model="mlp", update_mode="async") == 1
        assert value(s1, "psserver_trainer_up", rank="0", name="trainer_0_1") == 1
        assert value(s1, "psserver_trainers", state="ACTIVE") == 1
        assert value(s1, "psserver_loss") == 1.0
        assert value(s1, "psserver_updates_per_second") == 5.0
        assert value(s1, "psserver_staleness_bound") == 0  # async
        assert value(s1, "psserver_trainer_clock", rank="0", name="trainer_0_1") == 4
        assert value(s1, "psserver_trainer_staleness", rank="0", name="trainer_0_1") == 1
        assert value(s1, "psserver_trainer_max_staleness", rank="0", name="trainer_0_1") == 3
        assert ("psserver_checkpoint_age_seconds", ()) not in s1  # no checkpoint yet
        assert ("psserver_learning_rate", ()) not in s1  # the optimizer is not known yet
        assert any(k[0] == "process_resident_memory_bytes" for k in s1)

        target.step, target.loss, target.learning_rate = 7, float("nan"), 0.025
        target.trainers[0].state = "LOST"
        target.trainers.append(TrainerStatus(1, "trainer_1_1", "h", time.time(), time.time()))
        target.last_checkpoint = CheckpointInfo("/x/ckpt.pt", 5, time.time() - 30, duration_s=0.25)
        s2 = scrape(port)
        assert value(s2, "psserver_steps_total") == 7
        assert math.isnan(value(s2, "psserver_loss"))
        assert value(s2, "psserver_trainer_up", rank="0", name="trainer_0_1") == 0
        assert value(s2, "psserver_trainer_state", rank="0", name="trainer_0_1", state="LOST") == 1
        assert value(s2, "psserver_trainer_up", rank="1", name="trainer_1_1") == 1
        assert 29 < value(s2, "psserver_checkpoint_age_seconds") < 60
        assert value(s2, "psserver_checkpoint_last_step") == 5
        assert value(s2, "psserver_checkpoint_duration_seconds") == 0.25
        assert value(s2, "psserver_learning_rate") == 0.025
    finally:
        ex.close()
        ex.close()  # idempotent
    with pytest.raises(OSError):
        scrape(port)


def test_server_process_metrics_follow_the_snapshot():
    from psserver.exporters import start_exporters

    def of(samples: dict, metric: str) -> dict[str, float]:
        """{server label: value} of one metric."""
        return {dict(k[1])["server"]: v for k, v in samples.items() if k[0] == metric}

    names = ("psserver_server_process_up", "psserver_server_process_parameter_bytes",
             "psserver_server_process_updates_applied")
    target = FakeTarget()
    with start_exporters(target, ObservabilityConfig(metrics_port=0)) as ex:
        assert all(of(scrape(ex.metrics_port), n) == {} for n in names)  # one server process: no samples
        target.servers = [
            ServerProcessStatus(0, "ps_0", "hostA", "SERVING", 900, 3600, 12, last_seen_s=0.0),
            ServerProcessStatus(1, "ps_1", "hostB", "SERVING", 300, 1200, 11, last_seen_s=0.5),
            ServerProcessStatus(2, "ps_2", "", "MISSING", 34, 136, 0),
        ]
        s = scrape(ex.metrics_port)
        assert of(s, "psserver_server_process_up") == {"0": 1, "1": 1, "2": 0}
        assert of(s, "psserver_server_process_parameter_bytes") == {"0": 3600, "1": 1200, "2": 136}
        assert of(s, "psserver_server_process_updates_applied") == {"0": 12, "1": 11, "2": 0}
        assert value(s, "psserver_up") == 1  # server 0's own state is unchanged

        target.servers[1].state, target.servers[1].updates_applied = "LOST", 13
        del target.servers[2]  # gone from the snapshot: gone from the scrape
        s = scrape(ex.metrics_port)
        assert of(s, "psserver_server_process_up") == {"0": 1, "1": 0}
        assert of(s, "psserver_server_process_updates_applied") == {"0": 12, "1": 13}
        assert of(s, "psserver_server_process_parameter_bytes") == {"0": 3600, "1": 1200}


def test_embedding_metrics_follow_the_snapshot():
    from psserver.exporters import start_exporters

    def of(samples: dict, metric: str) -> dict[tuple[str, str], float]:
        """{(table, server): value} of one metric."""
        out = {}
        for (name, labels), v in samples.items():
            if name == metric:
                d = dict(labels)
                assert set(d) == {"table", "server"}, d
                out[(d["table"], d["server"])] = v
        return out

    gauges = ("rows", "max_rows", "bytes")
    counters = ("admissions", "refused", "evictions", "expirations", "lookups", "updates")
    names = [f"psserver_embedding_{n}" for n in gauges] + [f"psserver_embedding_{n}_total" for n in counters]
    target = FakeTarget()
    with start_exporters(target, ObservabilityConfig(metrics_port=0)) as ex:
        assert all(of(scrape(ex.metrics_port), n) == {} for n in names)  # a dense model: no samples
        target.tables = [
            TableStatus("users", 0, 1500, 2000, 16, 3 << 20, 1600, 250, 0, 100, 90000, 85000, lookups_per_s=12.0),
            TableStatus("items", 0, 40, 2000, 8, 4096, 40, 7, 0, 0, 9000, 8800),
            TableStatus("users", 1, 2000, 2000, 16, 4 << 20, 2600, 300, 600, 0, 95000, 90000),
        ]
        s = scrape(ex.metrics_port)
        assert of(s, "psserver_embedding_rows") == {("users", "0"): 1500, ("items", "0"): 40, ("users", "1"): 2000}
        assert of(s, "psserver_embedding_max_rows") == {("users", "0"): 2000, ("items", "0"): 2000,
                                                        ("users", "1"): 2000}
        assert of(s, "psserver_embedding_bytes") == {("users", "0"): 3 << 20, ("items", "0"): 4096,
                                                     ("users", "1"): 4 << 20}
        assert of(s, "psserver_embedding_admissions_total")[("users", "1")] == 2600
        assert of(s, "psserver_embedding_refused_total") == {("users", "0"): 250, ("items", "0"): 7,
                                                             ("users", "1"): 300}
        assert of(s, "psserver_embedding_evictions_total")[("users", "1")] == 600
        assert of(s, "psserver_embedding_expirations_total")[("users", "0")] == 100
        assert of(s, "psserver_embedding_lookups_total") == {("users", "0"): 90000, ("items", "0"): 9000,
                                                             ("users", "1"): 95000}
        assert of(s, "psserver_embedding_updates_total")[("items", "0")] == 8800
        assert value(s, "psserver_up") == 1

        target.tables.append(target.tables[0])  # a duplicate label set must not fail the scrape
        del target.tables[1]  # gone from the snapshot: gone from the scrape
        s = scrape(ex.metrics_port)
        assert set(of(s, "psserver_embedding_rows")) == {("users", "0"), ("users", "1")}


def test_readers_and_their_version_ages_are_exported():
    from psserver.exporters import start_exporters

    target = FakeTarget()
    with start_exporters(target, ObservabilityConfig(metrics_port=0)) as ex:
        assert not any(name.startswith("psserver_reader") for name, _ in scrape(ex.metrics_port))  # no weights served
        target.reader_ages = AgeHistogram()
        for age in (0.02, 0.3, 0.3, 4.0):
            target.reader_ages.observe(age)
        target.readers = [ReaderStatus("rollout-0", "ipv4:127.0.0.1:1", 7, time.time(), 0.3, 3)]
        s = scrape(ex.metrics_port)
        assert value(s, "psserver_readers") == 1
        assert value(s, "psserver_reader_version_age_seconds_bucket", le="0.025") == 1
        assert value(s, "psserver_reader_version_age_seconds_bucket", le="0.5") == 3
        assert value(s, "psserver_reader_version_age_seconds_bucket", le="+Inf") == 4
        assert value(s, "psserver_reader_version_age_seconds_count") == 4
        assert value(s, "psserver_reader_version_age_seconds_sum") == pytest.approx(4.62)


def test_waiting_state_and_checkpoint_schedule_are_exported_for_the_alerts():
    """deploy/prometheus/rules.yml alerts on a WAITING job and on a checkpoint older than its
    interval (or steps): both need the server to export them."""
    from psserver.exporters import start_exporters

    target = FakeTarget()
    with start_exporters(target, ObservabilityConfig(metrics_port=0)) as ex:
        s = scrape(ex.metrics_port)
        assert value(s, "psserver_state", state="WAITING") == 0
        assert value(s, "psserver_checkpoint_interval_seconds") == 0  # checkpoints off: 0, not absent
        assert value(s, "psserver_checkpoint_every_steps") == 0

        target.state, target.checkpoint_interval_s, target.checkpoint_every_steps = "WAITING", 60.0, 500
        s = scrape(ex.metrics_port)
        assert value(s, "psserver_state", state="WAITING") == 1
        assert value(s, "psserver_state", state="SERVING") == 0
        assert value(s, "psserver_up") == 0
        assert value(s, "psserver_checkpoint_interval_seconds") == 60
        assert value(s, "psserver_checkpoint_every_steps") == 500


def test_server_status_carries_the_checkpoint_schedule_only_with_a_checkpoint_dir(tmp_path):
    """The parameter server's status takes the schedule from --checkpoint-interval/--checkpoint-every,
    and 0 without --checkpoint-dir (no checkpoint will ever come: nothing to be late)."""
    from types import SimpleNamespace

    from psserver.config.ps import CheckpointConfig
    from psserver.server.status import ServerView

    def schedule(checkpoint: CheckpointConfig) -> tuple[float, int]:
        view = SimpleNamespace(config=SimpleNamespace(checkpoint=checkpoint))
        return ServerView.checkpoint_schedule(view)  # type: ignore[arg-type]

    assert schedule(CheckpointConfig(directory=tmp_path, every_steps=100, interval_s=30.0)) == (30.0, 100)
    assert schedule(CheckpointConfig(every_steps=100, interval_s=30.0)) == (0.0, 0)


def test_server_process_exporter_serves_its_rank_process_metrics_and_rpc_times():
    """Server i > 0 of --num-servers: Prometheus scrapes every server process (deploy/prometheus/),
    so each serves its own process metrics and RPC times; the job's state stays server 0's."""
    from psserver.exporters import observe_rpc, start_server_process_exporter

    assert start_server_process_exporter(ObservabilityConfig(), 1) is None  # no --metrics-port: nothing
    ex = start_server_process_exporter(ObservabilityConfig(metrics_port=0), 2)
    assert ex is not None
    try:
        observe_rpc("push", 0.002)
        s = scrape(ex.metrics_port)
        assert value(s, "psserver_server_rank") == 2
        assert value(s, "psserver_rpc_duration_seconds_count", method="push") == 1
        assert any(k[0] == "process_resident_memory_bytes" for k in s)
        assert not any(k[0] in {"psserver_up", "psserver_steps_total", "psserver_trainers"} for k in s)
    finally:
        ex.close()
    observe_rpc("push", 0.002)  # closed: unregistered


def test_two_exporters_in_one_process_and_rpc_histogram():
    from psserver.exporters import observe_rpc, rpc_timed, start_exporters

    a = start_exporters(FakeTarget(), ObservabilityConfig(metrics_port=0))
    b = start_exporters(FakeTarget(), ObservabilityConfig(metrics_port=0))
    try:
        assert a.metrics_port != b.metrics_port

        @rpc_timed("forward")
        def handler(x: int) -> int:
            time.sleep(0.003)
            return x + 1

        assert handler(1) == 2
        observe_rpc("heartbeat", 0.0004)
        for ex in (a, b):
            s = scrape(ex.metrics_port)
            assert value(s, "psserver_rpc_duration_seconds_count", method="forward") == 1
            assert value(s, "psserver_rpc_duration_seconds_sum", method="forward") >= 0.003
            assert value(s, "psserver_rpc_duration_seconds_bucket", method="heartbeat", le="0.0005") == 1
    finally:
        a.close()
        b.close()
    observe_rpc("forward", 0.1)  # no exporter left: a no-op


def test_metrics_port_in_use_is_a_usage_error():
    from psserver.exporters import start_exporters

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(UsageError, match="cannot serve metrics"):
            start_exporters(FakeTarget(), ObservabilityConfig(metrics_port=s.getsockname()[1]))


def test_scrape_survives_a_broken_target():
    from psserver.exporters import start_exporters

    target = FakeTarget()
    target.get_status = lambda: (_ for _ in ()).throw(RuntimeError("boom"))  # type: ignore[method-assign]
    with start_exporters(target, ObservabilityConfig(metrics_port=0)) as ex:
        assert value(scrape(ex.metrics_port), "psserver_scrape_error") == 1


def test_slow_connections_hold_no_thread_and_a_scrape_still_answers():
    from psserver.exporters import start_exporters

    with start_exporters(FakeTarget(), ObservabilityConfig(metrics_port=0)) as ex:
        threads = threading.active_count()
        slow = []
        try:
            for _ in range(300):  # a request never finished: each held a thread for ever
                s = socket.create_connection(("127.0.0.1", ex.metrics_port))
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                slow.append(s)
            assert value(scrape(ex.metrics_port), "psserver_up") == 1
            assert threading.active_count() == threads
        finally:
            for s in slow:
                s.close()


def test_tensorboard_scalars_by_global_step(tmp_path):
    pytest.importorskip("tensorboard")
    from psserver.exporters import start_exporters

    target = FakeTarget()
    ex = start_exporters(target, ObservabilityConfig(tensorboard_dir=tmp_path / "tb"), tensorboard_interval_s=0.1)
    try:
        for step in (10, 20, 30):
            target.learning_rate, target.loss, target.step = 0.001 * step, 1.0 / step, step  # the step last
            time.sleep(0.35)
    finally:
        ex.close()
    scalars = read_scalars(tmp_path / "tb")
    loss = scalars["loss/train"]
    assert [s for s, _ in loss][:3] == [10, 20, 30]
    assert loss[0][1] == pytest.approx(0.1)
    assert {"throughput/samples_per_s", "throughput/updates_per_s", "trainers/active"} <= set(scalars)
    assert scalars["throughput/samples_per_s"][0][1] == pytest.approx(320.0)
    assert scalars["optimizer/learning_rate"][:3] == [(10, pytest.approx(0.01)), (20, pytest.approx(0.02)),
                                                      (30, pytest.approx(0.03))]


def test_tensorboard_missing_is_one_line(monkeypatch, tmp_path):
    import builtins

    from psserver.exporters import start_exporters

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name.startswith(("torch.utils.tensorboard", "tensorboard")):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(UsageError, match="install tensorboard for --tensorboard-dir"):
        start_exporters(FakeTarget(), ObservabilityConfig(tensorboard_dir=tmp_path / "tb"))


# ---- a real server and trainer ---------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_real_server_metrics_during_training(tmp_path, procs):
    port, metrics_port = free_port(), free_port()
    tb = tmp_path / "tb"
    one_thread = {"OMP_NUM_THREADS": "1"}
    server = procs.server(
        port, "--model", "mlp", "--compute-threads", "1", "--metrics-port", str(metrics_port),
        "--tensorboard-dir", str(tb), "--trainer-timeout", "2", "--checkpoint-dir", str(tmp_path / "ck"),
        "--checkpoint-every", "100", wait=False, env=one_thread, log=tmp_path / "server.log",
    )
    wait_until(lambda: value(scrape(metrics_port), "psserver_up") == 1, 60, "server up", [server])
    trainer = procs.trainer(port, 0, "--epochs", "1000", "--max-steps", "100000", env=one_thread,
                            log=tmp_path / "trainer.log")

    def training_trainer() -> dict[str, str] | None:
        s = scrape(metrics_port)
        if value(s, "psserver_steps_total") == 0:
            return None
        up = [dict(k[1]) for k, v in s.items() if k[0] == "psserver_trainer_up" and v == 1]
        return up[0] if up else None

    name_labels = wait_until(training_trainer, 90, "the trainer to train", [server, trainer])
    assert name_labels["rank"] == "0"
    s1 = scrape(metrics_port)
    time.sleep(1.5)
    s2 = scrape(metrics_port)
    assert trainer.running(), f"the trainer should still be training:\n{trainer.tail()}"
    assert value(s2, "psserver_steps_total") > value(s1, "psserver_steps_total") > 0
    assert value(s2, "psserver_samples_total") > value(s1, "psserver_samples_total")
    assert value(s2, "psserver_updates_per_second") > 0
    assert math.isfinite(value(s2, "psserver_loss")) and value(s2, "psserver_loss") >= 0
    assert value(s2, "psserver_trainer_up", **name_labels) == 1
    assert value(s2, "psserver_trainer_steps_total", **name_labels) > 0
    assert value(s2, "psserver_trainers", state="ACTIVE") == 1
    wait_until(lambda: ("psserver_checkpoint_age_seconds", ()) in scrape(metrics_port), 30, "a checkpoint", [server])
    s3 = scrape(metrics_port)
    assert 0 <= value(s3, "psserver_checkpoint_age_seconds") < 60
    assert value(s3, "psserver_checkpoint_duration_seconds") > 0
    assert value(s3, "psserver_checkpoint_last_step") >= 100

    # Every call through the endpoint is timed, by its op (the default --compute trainer runs
    # --step pushpull, whose one call per step is "exchange").
    assert value(s3, "psserver_rpc_duration_seconds_count", method="exchange") > 0
    assert value(s3, "psserver_rpc_duration_seconds_count", method="join") == 1
    # The trainer's clock (steps started on the server) and the staleness of its updates: alone,
    # it always computes on the current weights.
    assert value(s3, "psserver_trainer_clock", **name_labels) >= value(s2, "psserver_trainer_clock", **name_labels) > 0
    assert value(s3, "psserver_trainer_staleness", **name_labels) == 0
    assert value(s3, "psserver_trainer_max_staleness", **name_labels) == 0
    assert value(s3, "psserver_staleness_bound") == 0  # async

    trainer.signal(signal.SIGKILL)
    trainer.wait(10)
    wait_until(lambda: value(scrape(metrics_port), "psserver_trainer_up", **name_labels) == 0,
          30, "the killed trainer to show as down", [server])
    s4 = scrape(metrics_port)
    assert value(s4, "psserver_trainer_state", state="LOST", **name_labels) == 1
    assert value(s4, "psserver_trainers", state="ACTIVE") == 0
    assert value(s4, "psserver_up") == 1

    server.signal(signal.SIGINT)
    assert server.wait(60) == 0, server.tail()
    scalars = read_scalars(tb)
    assert {"loss/train", "throughput/samples_per_s", "throughput/updates_per_s"} <= set(scalars)
    steps = [s for s, _ in scalars["throughput/samples_per_s"]]
    assert steps == sorted(steps) and steps[-1] > 0
    assert all(v >= 0 for _, v in scalars["loss/train"])


def test_serve_metrics_is_a_context_manager_for_collective_rank0():
    from psserver.exporters import serve_metrics

    with serve_metrics(FakeTarget(), ObservabilityConfig(metrics_port=0)) as ex:
        port = ex.metrics_port
        assert value(scrape(port), "psserver_up") == 1
    with pytest.raises(OSError):
        scrape(port)
