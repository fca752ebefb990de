"""The choice of the path a trainer's flat buffers take (``psserver.common.transport``), and what
the server makes of it at the join: pure decisions, tested without a GPU (``torch.device`` of a
CUDA index needs none)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from psserver.common import rendezvous
from psserver.common.transport import TransportPath, choose_path, device_maps, host_id
from psserver.config import TrainerConfig
from psserver.errors import UsageError
from psserver.server.steps.pushpull import PushPullServer
from psserver.server.steps.trainer_compute import TrainerComputeServer
from tests.end_to_end.joins import join_request, mlp_engine

CUDA0 = torch.device("cuda", 0)


def server(devices=("cuda:0",), num_servers=1, host=None) -> dict:
    """What a server publishes about where its model lives."""
    return {"devices": list(devices), "num_servers": num_servers, "host_id": host_id() if host is None else host}


def test_a_gpu_trainer_beside_a_gpu_server_goes_device_to_device():
    path = choose_path("auto", CUDA0, server(("cuda:1",)))
    assert path.kind == "device-map" and path.on_device and path.server_device == "cuda:1"
    assert path.describe(CUDA0) == "device-map cuda:0 -> server cuda:1: both on CUDA on one host: device to device " \
                                   "over CUDA IPC (TensorPipe copies through host memory where IPC is not viable)"
    assert device_maps(path, CUDA0, "ps") == {"ps": {CUDA0: torch.device("cuda", 1)}}
    assert choose_path("device-map", CUDA0, server()).kind == "device-map"


def test_a_device_map_that_failed_a_last_process_image_is_not_tried_again():
    path = choose_path("auto", CUDA0, server(("cuda:1",)), failed="cudaIpcOpenMemHandle failed")
    assert path.kind == "staged" and device_maps(path, CUDA0, "ps") is None
    assert path.reason == "the device map failed its probe (cudaIpcOpenMemHandle failed), so through pinned host memory"
    assert choose_path("cpu", CUDA0, server(), failed="x").kind == "cpu"  # asked for by name: as asked


@pytest.mark.parametrize(("published", "why"), [
    (server(host="elsewhere/boot"), "the server is on another host"),
    (server(("cpu",)), "the server's model is on cpu"),
    (server(("cuda:0", "cuda:1")), "the server holds the model over 2 devices"),
    (server(num_servers=2), "the model is spread over several server processes"),
    ({"model": "mlp"}, "the server did not say where its model is"),  # an older server
])
def test_a_gpu_trainer_that_cannot_map_is_staged_and_says_why(published, why):
    path = choose_path("auto", CUDA0, published)
    assert path.kind == "staged" and not path.on_device and path.reason.startswith(why)
    assert path.reason.endswith("so through pinned host memory") and device_maps(path, CUDA0, "ps") is None
    with pytest.raises(UsageError, match=f"--transport device-map cannot be used: {why}"):
        choose_path("device-map", CUDA0, published)


def test_the_path_asked_for_is_kept():
    assert choose_path("staged", CUDA0, server()).kind == "staged"  # slower than the map, but asked for
    assert choose_path("cpu", CUDA0, server()).kind == "cpu"
    cpu = choose_path("auto", torch.device("cpu"), server())
    assert (cpu.kind, cpu.reason) == ("cpu", "the trainer runs on the CPU")


def test_the_config_checks_the_flag():
    with pytest.raises(ValueError, match="--transport must be one of auto, device-map, staged, cpu"):
        TrainerConfig(transport="rdma")
    for asked in ("device-map", "staged"):
        with pytest.raises(ValueError, match=f"--transport {asked} needs a trainer on a GPU"):
            TrainerConfig(transport=asked)
    assert TrainerConfig(transport="device-map", device="cuda:0").transport == "device-map"
    # Checked once and frozen: a GPU path cannot be set on a CPU trainer's config afterwards.
    config = TrainerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.transport = "device-map"  # type: ignore[misc]
    with pytest.raises(ValueError, match="--transport device-map needs a trainer on a GPU"):
        dataclasses.replace(config, transport="device-map")


def test_tensorpipe_channels_from_the_environment(monkeypatch):
    monkeypatch.delenv("PSSERVER_TP_CHANNELS", raising=False)
    assert rendezvous.tp_channels() is None
    monkeypatch.setenv("PSSERVER_TP_CHANNELS", " cuda_basic, basic ")
    assert rendezvous.tp_channels() == ["cuda_basic", "basic"]
    options = rendezvous.backend_options("tcp://127.0.0.1:1", 5.0, 2)
    assert options.devices == [] and options.device_maps == {}
    for bad in ("nvlink", ",", "basic,,xpu"):
        monkeypatch.setenv("PSSERVER_TP_CHANNELS", bad)
        with pytest.raises(UsageError, match=r"PSSERVER_TP_CHANNELS=.*each must be one of basic, cma"):
            rendezvous.tp_channels()


@pytest.fixture
def engine():
    e = mlp_engine()
    yield e
    e.close()


def test_the_server_tells_each_trainer_the_path_its_protocol_can_take(engine):
    push, pull = PushPullServer(engine), TrainerComputeServer(engine)  # as --step pull: no device replies
    map_ = dataclasses.replace(join_request(name="a"), transport="device-map", transport_reason="one host")
    # The trainer's device map is of no use when the server's model is on the CPU.
    assert push.join_info("a", map_)["transport"] == {"kind": "staged", "reason": "the server's model is not on a GPU"}
    assert not push.on_device("a")
    staged = dataclasses.replace(join_request(name="b"), transport="staged", transport_reason="asked")
    assert push.join_info("b", staged)["transport"] == {"kind": "staged", "reason": "asked"}
    # --step pull sends through host memory: whatever the trainer asked, its path is the CPU's.
    assert pull.join_info("c", dataclasses.replace(staged, name="c"))["transport"]["kind"] == "cpu"
    cpu = join_request(name="d")
    assert push.join_info("d", cpu)["transport"] == {"kind": "cpu", "reason": ""}
    push.trainer_gone("b", False)
    assert "b" not in push._transport
    # What a trainer says goes to the log and the status: a known path, one bounded printable line.
    with pytest.raises(ValueError, match="unknown transport 'rdma'"):
        push.join_info("e", dataclasses.replace(cpu, name="e", transport="rdma"))
    forged = dataclasses.replace(cpu, name="f", transport_reason="ok\nWARNING forged line" + "x" * 500)
    reason = push.join_info("f", forged)["transport"]["reason"]
    assert reason.startswith("ok WARNING forged line") and len(reason) == 200


def test_a_flat_parameter_reply_on_the_shard_device(engine):
    engine.trainer_joined("t")
    host = engine.flat_parameters(torch.bfloat16)
    there = engine.flat_parameters(torch.bfloat16, on_device=True)
    assert [t.device for t in there] == [s.device for s in engine.shards]
    assert all(torch.equal(a, b) for a, b in zip(host, there, strict=True)) and host[0].dtype == torch.bfloat16


def test_transport_path_is_plain_data():
    path = TransportPath("cpu", "the trainer runs on the CPU")
    assert path.describe("cpu") == "cpu: the trainer runs on the CPU" and not path.on_device
