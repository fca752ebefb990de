"""GPU placement of the server's stages. Skipped on machines without CUDA."""

from __future__ import annotations

import json

import pytest
import torch

from psserver.cli import main
from tests.gpu import cuda_marks, needs_cuda
from tests.procs import accuracy, run

needs_gpu = needs_cuda()
needs_two = needs_cuda(2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a host without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error(capsys):
    assert main(["serve", "--devices", "cuda:0", "--no-control"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a host without CUDA")
@pytest.mark.timeout(60)
def test_trainer_device_without_cuda_is_a_clear_error():
    """Trainer compute's ``--device cuda:0`` on a host without CUDA: one line, exit 2, before
    any server is needed (a subprocess: the trainer sets the process's torch threads)."""
    r = run(["train", "--device", "cuda:0", "--server", "127.0.0.1:1", "--no-progress"], timeout=50)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "psserver train: error: --device cuda:0: CUDA is not available on this host"]


@needs_gpu
def test_shard_runs_on_its_device():
    from psserver.config import OptimizerConfig
    from psserver.server.engine.shard import Shard

    shard = Shard(0, torch.nn.Sequential(torch.nn.Linear(8, 4)), torch.device("cuda:0"))
    shard.init_optimizer(OptimizerConfig())
    out = shard.forward(torch.randn(3, 8), clone=True)
    assert out.device.type == "cuda"
    out.sum().backward()
    shard.apply({p: p.grad for p in shard.params})
    assert all(p.device.type == "cuda" for p in shard.params)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "model,devices",
    [
        pytest.param("mlp", "cuda:0", marks=cuda_marks()),
        pytest.param("mnist_cnn", "cuda:0,cuda:1", marks=cuda_marks(2)),
    ],
)
@pytest.mark.parametrize("step", ["plain", "chained", "pull", "pushpull"])
def test_server_on_gpus_trains(procs, port, model, devices, step):
    server = procs.server(port, "--model", model, "--devices", devices)
    n = len(devices.split(","))
    assert f"in {n} stage(s) on {devices.replace(',', ', ')}" in server.output()
    t = procs.trainer(port, 0, "--epochs", "2", "--step", step)
    assert t.wait(200) == 0, t.tail()
    assert accuracy(t) > 0.8


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@needs_gpu
@pytest.mark.parametrize("step,wire", [("pushpull", "fp32"), ("pushpull", "bf16"), ("pull", "fp32"), ("pull", "fp16")])
def test_trainer_computes_on_its_gpu(procs, port, step, wire):
    """Trainer compute on ``--device cuda:0`` against a CPU server: tensors cross RPC on the
    CPU in the wire dtype, the trainer's replica runs on its GPU."""
    server = procs.server(port, "--model", "mlp", "--devices", "cpu")
    t = procs.trainer(port, 0, "--epochs", "2", "--step", step, "--device", "cuda:0", "--wire-dtype", wire)
    assert t.wait(200) == 0, t.tail()
    assert f"--compute trainer --step {step} on cuda:0" in t.output(), t.tail()
    assert accuracy(t) > 0.8
    assert procs.stop(server) == 0, server.tail()


@needs_gpu
def test_a_server_on_a_gpu_says_its_state_is_not_kept_in_memory(tmp_path, caplog):
    """Device memory dies with the process: the state in memory is off, with its reason in the
    log and in ``psserver status``, not silently (a restart resumes from a checkpoint)."""
    from psserver.config import MemoryStateConfig, OptimizerConfig, ServerConfig
    from psserver.server.server import ParameterServer

    cfg = ServerConfig(model="mlp", devices=["cuda:0"], optimizer=OptimizerConfig(),
                       memory_state=MemoryStateConfig(tmp_path, "run-a"))
    with caplog.at_level("WARNING"):
        server = ParameterServer(cfg)
    try:
        assert server.memory.disabled == "the model lives on cuda:0, not in host memory"
        assert server.memory.describe().startswith("off: the model lives on cuda:0")
        assert "resumes from its last checkpoint" in caplog.text
    finally:
        server.engine.close()
        server.memory.release()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@needs_gpu
@pytest.mark.parametrize("transport", ["auto", "staged", "cpu"])
def test_gradient_buckets_go_ahead_on_every_path(procs, port, transport, tmp_path):
    """mnist_cnn at ``--bucket-cap-mb 1`` on cuda:0, its server's model on cuda:0: the 4.7 MB
    fc1.weight goes ahead as backward fills it, device to device (auto), through pinned or
    pageable host memory; sync steps all land once, and it learns. The path taken is the one
    asked for (``--stats-out``: a device map that failed its probe would go staged)."""
    server = procs.server(port, "--model", "mnist_cnn", "--devices", "cuda:0", "--update", "sync",
                          "--sync-trainers", "1")
    stats = tmp_path / "stats.json"
    t = procs.trainer(port, 0, "--epochs", "2", "--device", "cuda:0", "--transport", transport,
                      "--bucket-cap-mb", "1", "--stats-out", str(stats))
    assert t.wait(200) == 0, t.tail()
    assert "gradient buckets: 1 of 3 go ahead of the step's call" in t.output(), t.tail()
    took = json.loads(stats.read_text())["transport"]
    assert took == {"kind": {"auto": "device-map"}.get(transport, transport), "fell_back": None}, took
    assert accuracy(t) > 0.9
    assert procs.stop(server) == 0, server.tail()
