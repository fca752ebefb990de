"""The trainer half of trainer compute, against the server half, in one process without RPC.

A fake channel hands the trainer half's calls straight to the server half, so the replica's
device placement, the wire dtype both ways and the trainer-side evaluation are checked
without processes; the GPU cases run where a GPU is visible.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from psserver.config import OptimizerConfig, ServerConfig
from psserver.models import build_model
from psserver.ps.engine.engine import StepEngine, resolve_devices
from psserver.ps.protocols.pushpull import PushPullServer, PushPullTrainer
from psserver.ps.protocols.trainer_compute import WIRE_DTYPES
from tests.ps.joins import give_replica, join_request

CUDA = pytest.param("cuda:0", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")])


class Channel:
    """The ``Channel`` a trainer half sees, calling the server half in-process."""

    def __init__(self, half: PushPullServer, device: str, wire: str) -> None:
        self.name = "t"
        self.steps_before = 0
        self.half = half
        self.device = torch.device(device)
        self.wire_dtype = WIRE_DTYPES[wire]
        self.info: dict[str, Any] = {"model": "mlp", **half.join_info("t", join_request(wire_dtype=wire))}
        give_replica(self, "mlp")
        self.calls: list[str] = []

    def call(self, op: str, *args: Any) -> Any:
        assert op in self.half.ops
        self.calls.append(op)
        out = getattr(self.half, op)(self.name, *args)
        for t in out or ():  # what crosses RPC is on the CPU, in the wire dtype (the model's buffers: float64)
            assert t.device.type == "cpu" and t.dtype in (self.wire_dtype, torch.float64)
        return out


@pytest.fixture
def engine():
    cfg = ServerConfig(model="mlp", devices=["cpu"], optimizer=OptimizerConfig(name="adam", lr=0.01))
    e = StepEngine(cfg, resolve_devices(cfg.devices))
    e.trainer_joined("t")
    yield e
    e.close()


def batches(n: int, size: int = 16):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(size, 1, 28, 28, generator=g), torch.randint(0, 10, (size,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_the_replica_trains_on_its_device_like_a_local_loop(engine, device):
    trainer = PushPullTrainer(Channel(PushPullServer(engine), device, "fp32"))
    assert all(p.device == torch.device(device) for p in trainer.model.parameters())
    # The reference computes on the same device: a CPU loop would differ from the GPU's kernels by
    # rounding that Adam turns into steps of size lr wherever a gradient is near zero.
    ref = build_model("mlp", seed=0).to(device)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01, fused=True)  # as the server's (psserver.ps.engine.shard)
    for x, y in batches(5):
        loss = trainer.step(x, y)
        opt.zero_grad()
        ref_loss = nn.functional.cross_entropy(ref(x.to(device)), y.to(device))
        ref_loss.backward()
        opt.step()
        assert loss == pytest.approx(float(ref_loss.detach()), rel=1e-5 if device == "cpu" else 1e-4)
    trainer.flush()
    for p, q in zip(engine.params, ref.parameters(), strict=True):
        assert torch.allclose(p.detach(), q.detach().cpu(), atol=1e-5 if device == "cpu" else 1e-4)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_evaluation_runs_on_the_replica_with_the_servers_final_weights(engine, device):
    channel = Channel(PushPullServer(engine), device, "fp32")
    trainer = PushPullTrainer(channel)
    for x, y in batches(3):
        trainer.step(x, y)
    trainer.flush()
    x = torch.randn(32, 1, 28, 28)
    out = trainer.evaluate(x)
    out2 = trainer.evaluate(x)
    assert channel.calls.count("parameters") == 1  # loaded once for the whole evaluation
    assert out.device.type == "cpu" and torch.allclose(out, out2)
    assert torch.allclose(out, engine.evaluate(x), atol=1e-5 if device == "cpu" else 1e-4)
    assert trainer.model.training  # back to training mode for a later step


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_a_narrow_wire_trains_close_to_fp32_and_the_server_stays_fp32(wire):
    def run(wire: str) -> list[float]:
        cfg = ServerConfig(model="mlp", devices=["cpu"], optimizer=OptimizerConfig(name="adam", lr=0.01))
        e = StepEngine(cfg, resolve_devices(cfg.devices))
        try:
            e.trainer_joined("t")
            trainer = PushPullTrainer(Channel(PushPullServer(e), "cpu", wire))
            losses = [trainer.step(x, y) for x, y in batches(3) * 10]  # memorised: a loss that falls
            trainer.flush()
            assert all(p.dtype == torch.float32 for p in e.params)
            assert all(v.dtype == torch.float32 for s in e.shards for st in s.optimizer.state.values()
                       for v in st.values() if torch.is_tensor(v) and v.is_floating_point())
            return losses
        finally:
            e.close()

    full, narrow = run("fp32"), run(wire)
    assert narrow[-1] < narrow[0] * 0.5  # it learns
    assert narrow[-1] == pytest.approx(full[-1], rel=0.2, abs=0.05)


class PartitionChannel:
    """The channel of a trainer of several server processes: ``call_each`` hands each server
    its arguments, in-process (one engine per server rank)."""

    def __init__(self, halves: list[PushPullServer], plan: dict) -> None:
        self.name = "t"
        self.steps_before = 0
        self.halves = halves
        self.device = torch.device("cpu")
        self.wire_dtype = torch.float32
        self.servers = [f"server{i}" for i in range(len(halves))]
        request = join_request(model="mnist_cnn")
        self.info: dict[str, Any] = {"model": "mnist_cnn", **halves[0].join_info("t", request), "plan": plan}
        give_replica(self, "mnist_cnn")
        for half in halves[1:]:
            half.join_info("t", request)
        self.sent: list[list[int]] = []

    def call_each(self, op: str, args: list[tuple]) -> list[Any]:
        if op == "exchange":
            self.sent.append([0 if a[0] is None else a[0][0].numel() for a in args])
        return [getattr(half, op)(self.name, *a) for half, a in zip(self.halves, args, strict=True)]


def test_a_trainer_of_several_servers_trains_as_one_server():
    """``mnist_cnn`` over 3 server processes (its 9216x128 layer cut across them): a trainer's
    steps give the parameters of one server, each server gets only its slice of the gradient."""
    opt = OptimizerConfig(name="adam", lr=0.01)
    one = StepEngine(ServerConfig(model="mnist_cnn", devices=["cpu"], optimizer=opt), [torch.device("cpu")])
    parts = [StepEngine(ServerConfig(model="mnist_cnn", devices=["cpu"], optimizer=opt, num_servers=3, server_rank=i,
                                     coordinator=None if i == 0 else "127.0.0.1:1"), [torch.device("cpu")])
             for i in range(3)]
    try:
        for e in (one, *parts):
            e.trainer_joined("t")
        plan = parts[0].plan
        assert plan is not None and any(len({p.server for p in plan.pieces if p.param == i}) == 3
                                        for i in range(len(plan.sizes)))
        reference = Channel(PushPullServer(one), "cpu", "fp32")
        reference.info["model"] = "mnist_cnn"
        give_replica(reference, "mnist_cnn")
        single = PushPullTrainer(reference)
        channel = PartitionChannel([PushPullServer(e) for e in parts], plan.to_dict())
        several = PushPullTrainer(channel)
        for i, (x, y) in enumerate(batches(3)):
            torch.manual_seed(i)  # the same dropout masks in both replicas
            loss = several.step(x, y)
            torch.manual_seed(i)
            assert loss == pytest.approx(single.step(x, y), rel=1e-6)
        single.flush()
        several.flush()
        assert channel.sent[1] == plan.elements_per_server()  # each server its slice, no more
        got = plan.gather([e.flat_parameters()[0] for e in parts], one.params)
        for p, q in zip(one.params, got, strict=True):
            assert torch.allclose(p.detach(), q, atol=1e-6)
        x = torch.randn(8, 1, 28, 28)
        assert torch.allclose(several.evaluate(x), single.evaluate(x), atol=1e-5)
    finally:
        for e in (one, *parts):
            e.close()
