"""The trainer half of trainer compute, against the server half, in one process without RPC.

A fake channel hands the trainer half's calls straight to the server half, so the replica's
device placement, the wire dtype both ways and the trainer-side evaluation are checked
without processes; the GPU cases run where a GPU is visible.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from torch import nn

from psserver.common.devices import resolve_devices
from psserver.common.transport import WIRE_DTYPES
from psserver.config import OptimizerConfig, ServerConfig
from psserver.errors import DeviceMapFailed
from psserver.models import build_model
from psserver.server.engine.engine import StepEngine
from psserver.server.steps.pushpull import PushPullServer
from psserver.trainer.steps import trainer_compute
from psserver.trainer.steps.pushpull import PushPullTrainer
from tests.end_to_end.joins import give_replica, join_request, mlp_engine

CUDA = pytest.param("cuda:0", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")])


class Channel:
    """The ``Channel`` a trainer half sees, calling the server half in-process."""

    def __init__(self, half: PushPullServer, device: str, wire: str, overlap: str = "off") -> None:
        self.name = "t"
        self.steps_before = 0
        self.bucket_cap_mb = 25.0
        self.half = half
        self.device = torch.device(device)
        self.wire_dtype = WIRE_DTYPES[wire]
        self.info: dict[str, Any] = {"model": "mlp", **half.join_info("t", join_request(wire_dtype=wire,
                                                                                         overlap=overlap))}
        give_replica(self, "mlp")
        self.calls: list[str] = []
        self.parts: list[torch.Tensor] = []  # the values of every part sent
        self.fail: str | None = None  # an op that fails as a lost server's call does

    def call(self, op: str, *args: Any) -> Any:
        assert op in self.half.ops
        self.calls.append(op)
        if op == self.fail:
            raise RuntimeError("lost the server")
        if op == "part":
            self.parts += [values for _, _, values in args[1]]
        elif op == "exchange" and len(args) > 7:
            self.parts += [values for _, _, values in args[7]]
        out = getattr(self.half, op)(self.name, *args)
        for t in out or ():  # what crosses RPC is on the CPU, in the wire dtype (the model's buffers: float64)
            assert t.device.type == "cpu" and t.dtype in (self.wire_dtype, torch.float64)
        return out

    def call_async(self, op: str, *args: Any) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        try:
            future.set_result(self.call(op, *args))
        except Exception as e:  # noqa: BLE001 - the future carries it, as torch's RPC does
            future.set_exception(e)
        return future


@pytest.fixture
def engine():
    e = mlp_engine("t")
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
    opt = torch.optim.Adam(ref.parameters(), lr=0.01, fused=True)  # as the server's (psserver.server.engine.shard)
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
def test_the_gradient_filled_bucket_by_bucket_is_the_one_packed_after_backward(engine, device):
    channel = Channel(PushPullServer(engine), device, "bf16")
    channel.bucket_cap_mb = 4096 / 2**20  # 4 KB: several buckets of the mlp
    trainer = PushPullTrainer(channel)
    ptrs = set()
    for x, y in batches(2):
        x, y = x.to(device), y.to(device)
        expected = trainer.flat_grads(list(torch.autograd.grad(
            trainer.loss_fn(trainer.model(x), y), trainer.params, allow_unused=True)))
        expected = [[t.clone() for t in server] for server in expected]
        got = trainer.backward_flat(trainer.loss_fn(trainer.model(x), y))
        assert len(trainer._buckets[0]) > 2
        assert [[t.dtype for t in server] for server in got] == [[torch.bfloat16]]
        assert torch.equal(got[0][0].cpu(), expected[0][0].cpu())
        ptrs.add(trainer._buckets[0].flat.data_ptr())
    assert len(ptrs) == 1  # one buffer, reused by every step


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("wire", ["fp32", "bf16"])
def test_buckets_sent_ahead_as_parts_give_the_server_the_same_updates(device, wire, monkeypatch):
    """Each bucket but the last goes to the server while backward runs (``part``), the step's
    call carries the last: the server applies bit for bit what one whole gradient gives."""
    monkeypatch.setattr(trainer_compute, "PART_MIN_BYTES", 1)  # every bucket of the small mlp
    engines = [mlp_engine("t"), mlp_engine("t")]
    try:
        trainers = []
        for e, parts in zip(engines, (True, False), strict=True):
            channel = Channel(PushPullServer(e), device, wire)
            channel.bucket_cap_mb = 4096 / 2**20  # 4 KB: several buckets
            trainer = PushPullTrainer(channel)
            assert trainer.send_parts  # one server, no tables, no overlap
            trainer.send_parts = parts
            trainers.append(trainer)
        parted, whole = trainers
        for x, y in batches(4):
            assert parted.step(x, y) == whole.step(x, y)
        for t in trainers:
            t.flush()
        for p, q in zip(*(e.params for e in engines), strict=True):
            assert torch.equal(p, q)
        calls = parted.channel.calls
        buckets = len(parted._buckets[0])
        assert buckets > 2 and calls.count("part") == 4 * (buckets - 1) and calls.count("exchange") == 5
        assert "part" not in whole.channel.calls
        for values in parted.channel.parts:  # each its own tensor: RPC would send a view's whole buffer
            assert values.untyped_storage().nbytes() == values.numel() * values.element_size()
    finally:
        for e in engines:
            e.close()


def test_a_part_that_fails_fails_its_step_and_nothing_is_owed(engine, monkeypatch):
    monkeypatch.setattr(trainer_compute, "PART_MIN_BYTES", 1)
    channel = Channel(PushPullServer(engine), "cpu", "fp32")
    channel.bucket_cap_mb = 4096 / 2**20
    trainer = PushPullTrainer(channel)
    (x, y), (x2, y2) = batches(2)
    trainer.step(x, y)
    channel.fail = "part"
    with pytest.raises(RuntimeError, match="lost the server"):
        trainer.step(x2, y2)
    assert trainer.owed_samples() is None and trainer.seq == 1  # step 1 handed in, step 2 not made
    channel.fail = None
    trainer.step(x2, y2)  # made again
    trainer.flush()
    assert engine.global_step == 2


def test_the_server_refuses_a_call_that_ends_parts_without_its_number(engine):
    half = PushPullServer(engine)
    half.join_info("t", join_request())
    with pytest.raises(ValueError, match="numbered call"):
        half.exchange("t", None, 16, None, None, None, None, None, [])
    with pytest.raises(ValueError, match="numbered call"):
        half.exchange("t", [torch.zeros(engine.num_params)], 16, None, None, None, None, 1, [])
    with pytest.raises(ValueError, match="parts of step 1 do not cover shard 0"):
        half.exchange("t", None, 16, None, None, None, None, 1, [])
    for bad in (0, 2**62 + 1):
        with pytest.raises(ValueError, match=r"number must be an int in \[1, 2\*\*62\]"):
            half.part("t", bad, [])
    with pytest.raises(ValueError, match=r"samples must be an int in \[0, 2\*\*40\]"):
        half.exchange("t", None, 16, None, None, None, 2**40 + 1)
    with pytest.raises(ValueError, match="a list of"):
        half.part("t", 1, "parts")


def test_a_bad_sample_count_changes_nothing_and_the_next_step_goes_through(engine):
    """A step's samples go into the journal and the checkpoints: a float, NaN, a negative or a
    count past 2**40 is refused before any part of the step is taken, and the trainer's next,
    good step is applied as if the bad one never came."""
    half = PushPullServer(engine)
    half.join_info("t", join_request())
    half.exchange("t", None, 16)
    grads = [torch.ones(engine.num_params)]
    for bad in (2**63, float("nan"), -1, 1.5, True):
        with pytest.raises(ValueError, match=r"samples must be an int in \[0, 2\*\*40\]"):
            half.exchange("t", grads, bad)
        assert engine.global_step == 0
    half.exchange("t", grads, 16)
    assert engine.global_step == 1


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_an_overlapped_trainer_computes_on_the_reply_before_the_last(engine, device):
    """--overlap on: step t (t >= 2) computes on the parameters of step t-1's reply, while
    step t's exchange hands in step t-1's gradient; the server ends where a local loop that
    delays its gradients so ends, each update one step stale."""
    trainer = PushPullTrainer(Channel(PushPullServer(engine), device, "fp32", overlap="on"))
    assert trainer.overlap
    ref = build_model("mlp", seed=0).to(device)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01, fused=True)
    snapshots = [[p.detach().clone() for p in ref.parameters()]]  # the weights after k updates
    work = build_model("mlp", seed=0).to(device)  # the gradients' replica
    pending: tuple[torch.Tensor, ...] = ()
    for t, (x, y) in enumerate(batches(6), start=1):
        trainer.step(x, y)
        # the reference: step t's gradient on the weights after t-2 updates (t = 1: the initial)
        with torch.no_grad():
            for p, v in zip(work.parameters(), snapshots[max(0, t - 2)], strict=True):
                p.copy_(v)
        loss = nn.functional.cross_entropy(work(x.to(device)), y.to(device))
        g = torch.autograd.grad(loss, list(work.parameters()))
        if t > 1:  # step t's exchange applied step t-1's gradient (kept from the last round)
            apply(opt, ref, pending)
            snapshots.append([p.detach().clone() for p in ref.parameters()])
        pending = g
    trainer.flush()
    apply(opt, ref, pending)
    tol = 1e-5 if device == "cpu" else 1e-4
    for p, q in zip(engine.params, ref.parameters(), strict=True):
        assert torch.allclose(p.detach(), q.detach().cpu(), atol=tol)
    assert engine.updater.progress("t").staleness == 1 and trainer._buckets[0].index in (0, 1)
    trainer.close()  # the replica outlives the session: its hooks and buffers go
    assert trainer._buckets is None and not any(p._backward_hooks for p in trainer.params)


def apply(opt, model, grads) -> None:
    for p, g in zip(model.parameters(), grads, strict=True):
        p.grad = g.clone()
    opt.step()
    opt.zero_grad()


def test_the_server_says_where_a_trainer_may_overlap():
    def agreed(update: str, overlap: str, device: str = "cpu", staleness: int = 4) -> dict:
        cfg = ServerConfig(model="mlp", devices=["cpu"], update=update, staleness=staleness,
                           optimizer=OptimizerConfig(name="adam", lr=0.01))
        e = StepEngine(cfg, resolve_devices(cfg.devices))
        try:
            return PushPullServer(e).join_info("t", join_request(overlap=overlap, device=device))["overlap"]
        finally:
            e.close()

    assert agreed("async", "on") == {"on": True, "reason": "async: each step computes on the reply before the last"}
    assert agreed("async", "auto")["on"] is False and "CPU trainer" in agreed("async", "auto")["reason"]
    assert agreed("async", "auto", device="cuda:0")["on"] is True  # the default of a GPU trainer
    assert "one step tighter under --staleness 4" in agreed("ssp", "on")["reason"]
    assert agreed("ssp", "auto", device="cuda:0")["on"] is False  # asked for only in ssp
    assert agreed("sync", "auto", device="cuda:0") == {"on": False,
                                                       "reason": "sync mode: every step waits for its round's update"}
    assert agreed("async", "off", device="cuda:0") == {"on": False, "reason": "--overlap off"}
    with pytest.raises(ValueError, match="--overlap on: not with sync mode"):
        agreed("sync", "on")
    with pytest.raises(ValueError, match="not with ssp with --staleness 0"):
        agreed("ssp", "on", staleness=0)
    with pytest.raises(ValueError, match="unknown --overlap 'sometimes'"):
        agreed("async", "sometimes")


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
        self.bucket_cap_mb = 25.0
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


def test_a_device_map_that_cannot_carry_tensors_turns_the_trainer_staged(engine, caplog):
    """The first call of a device-map trainer probes the path; when it fails (here as TensorPipe
    refuses a CUDA tensor without a map), the trainer and the server both go staged and say why."""
    half = PushPullServer(engine)
    channel = Channel(half, "cpu", "fp32")
    half._transport["t"] = ("device-map", "both on CUDA on one host")  # as a GPU join would leave it
    channel.info["transport"] = {"kind": "device-map", "reason": "both on CUDA on one host"}

    def refuse(trainer, x):
        raise RuntimeError("TensorPipe RPC backend only supports CPU tensors by default\nmore")

    half.probe = refuse
    with caplog.at_level(logging.WARNING):
        trainer = PushPullTrainer(channel)
    assert channel.calls[:2] == ["probe", "fall_back"] and trainer.transport == "staged"
    assert trainer.fell_back == "TensorPipe RPC backend only supports CPU tensors by default"
    kind, why = half.transport_of("t")
    assert kind == "staged" and why.startswith("the device map failed (TensorPipe RPC backend only supports CPU")
    assert not half.on_device("t")
    assert any("the device map to the server failed" in r.getMessage() for r in caplog.records)


def test_a_probe_failure_that_breaks_the_pipe_asks_for_a_fresh_process(engine):
    """A transport-level failure marks the pipe to the server failed, so the ``fall_back`` call
    fails too: the trainer raised that call's error and died instead of going staged."""
    half = PushPullServer(engine)
    channel = Channel(half, "cpu", "fp32")
    half._transport["t"] = ("device-map", "both on CUDA on one host")
    channel.info["transport"] = {"kind": "device-map", "reason": "both on CUDA on one host"}

    def pipe_failed(*args):
        raise RuntimeError("pipe closed: connection reset by peer")

    half.probe = half.fall_back = pipe_failed
    with pytest.raises(DeviceMapFailed, match=r"^the device map to the server failed \(pipe closed: connection "
                                              r"reset by peer\) and took the connection with it$") as failed:
        PushPullTrainer(channel)
    assert failed.value.reason == "pipe closed: connection reset by peer"
    assert channel.calls == ["probe", "fall_back"]


def test_a_device_map_that_works_is_kept(engine):
    half = PushPullServer(engine)
    channel = Channel(half, "cpu", "fp32")
    half._transport["t"] = ("device-map", "one host")
    channel.info["transport"] = {"kind": "device-map", "reason": "one host"}
    trainer = PushPullTrainer(channel)  # the probe's value comes back plus one, on the trainer's device
    assert channel.calls == ["probe"] and trainer.transport == "device-map" and half.on_device("t")
    assert trainer.fell_back is None
    with pytest.raises(ValueError, match="not one value on the server's cpu"):
        half.probe("t", torch.ones(2))
    half.trainer_gone("t", False)
    with pytest.raises(ValueError, match="only a trainer on the device-map path"):
        half.probe("t", torch.ones(1))
    with pytest.raises(ValueError, match="only a trainer on the device-map path"):
        half.fall_back("t", "x")
