"""GPU placement of the server's stages. Skipped on machines without CUDA."""

from __future__ import annotations

import pytest
import torch

from psserver.cli import main
from tests.procs import accuracy

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a host without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error(capsys):
    assert main(["serve", "--devices", "cuda:0", "--no-control"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


@needs_gpu
def test_shard_runs_on_its_device():
    from psserver.config import OptimizerConfig
    from psserver.ps.shard import Shard

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
        pytest.param("mlp", "cuda:0", marks=needs_gpu),
        pytest.param("mnist_cnn", "cuda:0,cuda:1", marks=needs_two),
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
