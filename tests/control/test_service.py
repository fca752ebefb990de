"""ControlService through a real gRPC server on loopback, with a fake but live target."""

from __future__ import annotations

import dataclasses
import math
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from psserver.config.control import ControlConfig
from psserver.control import SERVICE_NAME, convert
from psserver.control.client import ControlClient, ControlError
from psserver.control.server import ControlServer
from psserver.control.v1 import control_pb2 as pb
from psserver.telemetry import ServerProcessStatus, ServerStatus, TableStatus, TrainerStatus

from .fakes import TOKEN, FakeTarget, serve, two_servers, two_tables

pytestmark = pytest.mark.timeout(60)


def _wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# ---- health -------------------------------------------------------------------------------


def test_health_follows_ready_through_the_standard_stub():
    target = FakeTarget(ready=False)
    try:
        with serve(target) as control, grpc.insecure_channel(control.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> int:
                return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

            NOT, OK = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
            assert status("") == NOT and status(SERVICE_NAME) == NOT
            watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert next(watch).status == NOT
            target.ready.set()
            assert next(watch).status == OK  # pushed, not polled by the client
            watch.cancel()
            assert status("") == OK and status(SERVICE_NAME) == OK
            target.ready.clear()  # the target stops being ready (drain)
            assert _wait_for(lambda: status("") == NOT and status(SERVICE_NAME) == NOT)
            with pytest.raises(grpc.RpcError) as e:
                status("no.such.Service")
            assert e.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        target.close()


def test_health_turns_not_serving_when_the_control_server_stops(target):
    control = serve(target)
    with ControlClient(control.address) as client:
        assert _wait_for(lambda: client.health() == "SERVING")
        control.stop()
        # The servicer outlives the gRPC server: ask it directly what it would answer now.
        resp = control.health.Check(health_pb2.HealthCheckRequest(service=""), None)
        assert resp.status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(ControlError):
            client.health(timeout=1)


def test_set_serving_flips_health_at_once(target):
    target.ready.clear()
    with serve(target) as control, ControlClient(control.address) as client:
        assert client.health(SERVICE_NAME) == "NOT_SERVING"
        target.ready.set()
        control.set_serving(True)
        assert client.health(SERVICE_NAME) == "SERVING"


# ---- reads -------------------------------------------------------------------------------


def test_get_status_carries_every_field(server, target):
    time.sleep(0.2)  # let the fake train a few steps
    with ControlClient(server.address) as client:
        st = client.get_status()
    assert st.version == "0.1.0"
    assert st.state == pb.SERVER_STATE_SERVING and st.mode == pb.MODE_PS
    assert st.update_mode == pb.UPDATE_MODE_SYNC and st.sync_trainers == 2
    assert st.model == "mlp" and st.num_params == 1234
    assert 120 < st.uptime_seconds < 200
    assert st.global_step > 0 and st.samples_seen > 0
    assert st.updates_per_second > 0 and st.samples_per_second > 0
    assert st.HasField("mean_loss") and 0 < st.mean_loss <= 1
    shards = [(s.index, s.device, s.num_params, s.bytes) for s in st.shards]
    assert shards == [(0, "cpu", 1000, 4000), (1, "cpu", 234, 936)]
    assert [s.state_bytes for s in st.shards] == [12016, 0]
    assert not st.HasField("last_checkpoint")
    assert abs(st.server_time - time.time()) < 5
    assert len(st.servers) == 0  # one server process: no list


def test_get_status_carries_every_server_process(server, target):
    target.servers = two_servers()
    with ControlClient(server.address) as client:
        st = client.get_status()
    assert [(s.rank, s.name, s.host, s.state) for s in st.servers] == [
        (0, "ps_0", "hostA", pb.SERVER_PROCESS_STATE_SERVING),
        (1, "ps_1", "hostB", pb.SERVER_PROCESS_STATE_LOST),
    ]
    assert [(s.num_params, s.bytes, s.updates_applied) for s in st.servers] == [(3000, 12000, 40), (1000, 4000, 38)]
    assert [s.last_seen_age_seconds for s in st.servers] == [0.0, 75.0]
    # ... and back: the dataclasses server 0 reported, field for field.
    assert [convert.server_process_from_proto(s) for s in st.servers] == two_servers()
    d = convert.status_to_dict(st)
    assert d["servers"][1] == {"rank": 1, "name": "ps_1", "host": "hostB", "state": "LOST", "num_params": 1000,
                               "bytes": 4000, "updates_applied": 38, "last_seen_age_seconds": 75.0}


def test_server_process_conversion_of_odd_values():
    never = ServerProcessStatus(rank=2, name="ps_2", host="", state="MISSING", parameters=0, parameter_bytes=0,
                                updates_applied=0)  # last_seen_s: NaN, it never answered
    msg = convert.server_process_to_proto(never)
    assert msg.state == pb.SERVER_PROCESS_STATE_MISSING and not msg.HasField("last_seen_age_seconds")
    assert convert.server_process_to_dict(msg)["last_seen_age_seconds"] is None  # JSON null, not NaN
    back = convert.server_process_from_proto(msg)
    assert back.state == "MISSING" and math.isnan(back.last_seen_s)
    assert (back.rank, back.name, back.parameters, back.parameter_bytes) == (2, "ps_2", 0, 0)
    weird = ServerProcessStatus(3, "ps_3", "h", "exploded", 5, 20, 1, last_seen_s=math.inf)
    msg = convert.server_process_to_proto(weird)
    assert msg.state == pb.SERVER_PROCESS_STATE_UNSPECIFIED and not msg.HasField("last_seen_age_seconds")
    assert convert.server_process_from_proto(msg).state == "UNSPECIFIED"
    # A message from a newer server, with a state this client does not know yet.
    newer = pb.ServerProcess(rank=1, state=17, last_seen_age_seconds=2.5)
    assert convert.server_process_to_dict(newer)["state"] == "UNKNOWN(17)"
    assert convert.server_process_from_proto(newer).last_seen_s == 2.5


def test_get_status_carries_every_embedding_table(server, target):
    target.tables = two_tables()
    with ControlClient(server.address) as client:
        st = client.get_status()
    assert [(t.table, t.server_rank, t.rows, t.max_rows, t.dim) for t in st.tables] == [
        ("users", 0, 1500, 2000, 16), ("items", 0, 40, 2000, 8), ("users", 1, 2000, 2000, 16)]
    assert [(t.admissions, t.refused, t.evictions, t.expirations) for t in st.tables] == [
        (1600, 250, 0, 100), (40, 7, 0, 0), (2600, 300, 600, 0)]
    assert st.tables[0].lookups_per_second == 1234.5 and st.tables[0].updates_per_second == 1200.5
    # ... and back: the dataclasses the server reported, field for field.
    assert [convert.table_from_proto(t) for t in st.tables] == two_tables()
    d = convert.status_to_dict(st)
    assert d["tables"][2] == {"table": "users", "server_rank": 1, "rows": 2000, "max_rows": 2000, "dim": 16,
                              "bytes": 4 << 20, "admissions": 2600, "refused": 300, "evictions": 600,
                              "expirations": 0, "lookups": 95000, "updates": 90000, "lookups_per_second": 1300.0,
                              "updates_per_second": 1250.0}


def test_table_conversion_of_odd_values():
    fresh = TableStatus("t", 0, 0, 10, 4, 0, 0, 0, 0, 0, 0, 0)  # rates left at their default
    assert convert.table_from_proto(convert.table_to_proto(fresh)) == fresh
    odd = TableStatus("t", 2, 1, 10, 4, 64, 1, 0, 0, 0, 3, 3, lookups_per_s=math.nan, updates_per_s=math.inf)
    msg = convert.table_to_proto(odd)
    assert msg.lookups_per_second == 0.0 and msg.updates_per_second == 0.0  # valid JSON, never NaN
    assert convert.table_to_dict(msg)["server_rank"] == 2


def test_list_trainers(server):
    with ControlClient(server.address) as client:
        trainers = client.list_trainers()
    assert [(t.rank, t.name, t.host, t.state) for t in trainers] == [
        (0, "trainer_0_0", "hostA", pb.TRAINER_STATE_ACTIVE),
        (1, "trainer_1_0", "hostB", pb.TRAINER_STATE_LOST),
    ]
    assert trainers[0].steps == 10 and trainers[0].samples == 640 and trainers[0].last_loss == 0.5
    assert trainers[0].samples_per_second == 100.0 and trainers[0].joined_at < trainers[0].last_seen
    assert not trainers[1].HasField("last_loss")  # NaN on the target: absent on the wire
    assert (trainers[0].clock, trainers[0].staleness, trainers[0].max_staleness) == (11, 2, 5)
    assert (trainers[1].clock, trainers[1].staleness, trainers[1].max_staleness) == (0, 0, 0)


def test_ssp_status_carries_its_staleness_bound(server, target):
    target.update_mode, target.sync_trainers, target.staleness = "ssp", 0, 4
    with ControlClient(server.address) as client:
        st = client.get_status()
    assert st.update_mode == pb.UPDATE_MODE_SSP and st.staleness == 4 and st.sync_trainers == 0
    d = convert.status_to_dict(st)
    assert d["update_mode"] == "ssp" and d["staleness"] == 4


def test_conversion_of_odd_values():
    now = time.time()
    status = ServerStatus(
        version="9", state="weird", mode="fsdp", started_at=now, model="m", num_params=0, update_mode="collective",
        sync_trainers=0, global_step=0, samples_seen=0, updates_per_s=math.nan, samples_per_s=math.inf,
        mean_loss=math.nan,
    )
    msg = convert.status_to_proto(status, now=now)
    d = convert.status_to_dict(msg)
    assert d["state"] == "UNSPECIFIED" and d["mode"] == "fsdp" and d["update_mode"] == "collective"
    assert d["mean_loss"] is None and d["updates_per_second"] == 0.0 and d["samples_per_second"] == 0.0
    assert d["last_checkpoint"] is None and d["shards"] == [] and d["servers"] == [] and d["tables"] == []
    assert d["learning_rate"] is None and d["lr_schedule"] == ""  # NaN (collective): absent, JSON null
    scheduled = dataclasses.replace(status, learning_rate=0.05, lr_schedule="StepLR(step_size=10)")
    d = convert.status_to_dict(convert.status_to_proto(scheduled, now=now))
    assert d["learning_rate"] == 0.05 and d["lr_schedule"] == "StepLR(step_size=10)"
    t = convert.trainer_to_dict(convert.trainer_to_proto(TrainerStatus(3, "rank3", "h", now, now, state="LEFT")))
    assert t["state"] == "LEFT" and t["last_loss"] is None
    assert convert.enum_name(pb.ServerState, 42) == "UNKNOWN(42)"


def test_target_failure_is_internal_and_the_server_keeps_serving(server, target, monkeypatch):
    def broken():
        raise ValueError("boom")

    monkeypatch.setattr(target, "list_trainers", broken)
    with ControlClient(server.address) as client:
        with pytest.raises(ControlError) as e:
            client.list_trainers()
        assert e.value.code == grpc.StatusCode.INTERNAL and "boom" in str(e.value)
        assert client.get_status().state == pb.SERVER_STATE_SERVING


# ---- WatchStatus -------------------------------------------------------------------------


def test_watch_delivers_updates_and_ends_when_the_client_cancels(server, target):
    with ControlClient(server.address) as client:
        stream = client.watch(interval=0.1)
        steps = []
        t0 = time.monotonic()
        for status in stream:
            steps.append(status.global_step)
            if len(steps) == 4:
                break
        elapsed = time.monotonic() - t0
        stream.close()  # cancels the call
        assert len(steps) == 4 and steps == sorted(steps) and steps[-1] > steps[0]
        assert 0.25 < elapsed < 5
        assert _wait_for(lambda: server.service.watchers == 0), "the stream did not end on the server"
        assert client.get_status().state == pb.SERVER_STATE_SERVING


def test_watch_ends_with_ok_when_the_server_stops(target):
    control = serve(target)
    with ControlClient(control.address) as client:
        stream = client.watch(interval=1.0)
        next(stream)
        threading.Timer(0.2, control.stop).start()
        t0 = time.monotonic()
        rest = list(stream)  # ends without raising: OK, not CANCELLED/UNAVAILABLE
        assert time.monotonic() - t0 < 3
        assert len(rest) <= 1


def test_watch_ends_after_a_stopped_status(server, target):
    with ControlClient(server.address) as client:
        threading.Timer(0.3, setattr, (target, "state", "STOPPED")).start()
        states = [s.state for s in client.watch(interval=0.1)]
    assert len(states) >= 2 and states[-1] == pb.SERVER_STATE_STOPPED
    assert all(s == pb.SERVER_STATE_SERVING for s in states[:-1])


@pytest.mark.parametrize("interval", [-1.0, 0.05, 1e9, math.nan, math.inf])
def test_watch_rejects_an_invalid_interval(server, interval):
    with ControlClient(server.address) as client:
        with pytest.raises(ControlError) as e:
            next(client.watch(interval=interval))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert client.get_status().state == pb.SERVER_STATE_SERVING


def test_too_many_watchers_are_refused(target):
    with ControlServer(target, ControlConfig(port=0), max_watchers=1, grace=0.2) as control:
        with ControlClient(control.address) as client:
            first = client.watch(interval=0.5)
            next(first)
            with pytest.raises(ControlError) as e:
                next(client.watch(interval=0.5))
            assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            first.close()
            assert _wait_for(lambda: control.service.watchers == 0)
            second = client.watch(interval=0.5)
            assert next(second).state == pb.SERVER_STATE_SERVING
            second.close()


# ---- Checkpoint and Shutdown ------------------------------------------------------------------


def test_checkpoint_returns_the_path_the_target_wrote(target, token_file):
    with serve(target, auth_token_file=token_file) as control, ControlClient(control.address, token=TOKEN) as client:
        info = client.checkpoint()
        assert info.path == target.checkpoints[-1].path and info.step == target.checkpoints[-1].step
        assert info.time > 0
        st = client.get_status()
        assert st.last_checkpoint.path == info.path and st.last_checkpoint.step == info.step


def test_checkpoint_without_a_checkpoint_dir_is_failed_precondition():
    target = FakeTarget(checkpoint_dir=None)
    try:
        with serve(target, allow_unauthenticated_admin=True) as control, ControlClient(control.address) as client:
            with pytest.raises(ControlError) as e:
                client.checkpoint()
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "not configured" in str(e.value)
    finally:
        target.close()


def test_checkpoint_failure_is_internal(target, monkeypatch):
    def disk_full():
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(target, "checkpoint_now", disk_full)
    with serve(target, allow_unauthenticated_admin=True) as control, ControlClient(control.address) as client:
        with pytest.raises(ControlError) as e:
            client.checkpoint()
        assert e.value.code == grpc.StatusCode.INTERNAL and "No space left" in str(e.value)


def test_shutdown_calls_request_shutdown(target):
    with serve(target, allow_unauthenticated_admin=True) as control, ControlClient(control.address) as client:
        state = client.shutdown(reason="test")
        assert target.shutdown_requested.is_set()
        assert state == pb.SERVER_STATE_DRAINING
        assert client.get_status().state == pb.SERVER_STATE_DRAINING
