"""The step protocols' server halves driven in-process, through the engine, without RPC.

The same code the endpoint dispatches to: ``PlainServer.forward``/``submit`` and
``ChainedServer.step``, each checked against a local training loop.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psserver.common.devices import resolve_devices
from psserver.config import OptimizerConfig, ServerConfig
from psserver.models import build_model
from psserver.server.engine.engine import ShuttingDown, StepEngine
from psserver.server.steps import HALVES as SERVER_HALVES
from psserver.server.steps.chained import ChainedServer
from psserver.server.steps.plain import PlainServer
from psserver.server.steps.pull import PullServer
from psserver.server.steps.pushpull import PushPullServer
from psserver.trainer.steps import HALVES as TRAINER_HALVES
from tests.end_to_end.joins import join_request

CUDA = pytest.param("cuda:0", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")])


@pytest.fixture
def make_engine():
    engines: list[StepEngine] = []

    def make(update: str = "async", optimizer: str = "adam", device: str = "cpu", lr: float = 0.01, k: int = 2):
        cfg = ServerConfig(model="mlp", update=update, sync_trainers=k, devices=[device],
                           optimizer=OptimizerConfig(name=optimizer, lr=lr))
        engine = StepEngine(cfg, resolve_devices(cfg.devices))
        engines.append(engine)
        steps: list[tuple[int, int]] = []
        engine.listeners.append(lambda step, samples: steps.append((step, samples)))
        return engine, steps

    yield make
    for e in engines:
        e.close()


def batches(n: int, size: int = 8, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 1, 28, 28, generator=g), torch.randint(0, 10, (size,), generator=g)) for _ in range(n)]


def local_loop(data, lr: float = 0.01):
    """The reference: forward, backward, Adam step, in one process."""
    model = build_model("mlp", seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses, list(model.parameters())


def output_grad(out: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
    """What a chained trainer does with an output: its loss and dL/d output."""
    out = out.clone().requires_grad_(True)
    loss = nn.functional.cross_entropy(out, y)
    (g,) = torch.autograd.grad(loss, (out,))
    return float(loss.detach()), g


def backward_and_submit(engine: StepEngine, half, out: torch.Tensor, y: torch.Tensor) -> float:
    """Without RPC an output stays tied to the server's parameters: its backward fills their
    ``.grad``, handed over as ``SharedOptimizer.step`` hands it; the loss."""
    loss = nn.functional.cross_entropy(out, y)
    loss.backward()
    grads = {p: p.grad for p in engine.params if p.grad is not None}
    for p in engine.params:
        p.grad = None
    half.submit("t", grads)
    return float(loss.detach())


def assert_same_weights(engine: StepEngine, ref: list[torch.Tensor], device: str) -> None:
    for p, q in zip(engine.params, ref, strict=True):
        assert p.device == torch.device(device)
        assert torch.allclose(p.detach().cpu(), q.detach(), atol=1e-5 if device == "cpu" else 1e-4)


def test_every_registered_protocol_is_a_step_mode():
    from psserver.config.ps import STEP_MODES

    assert sorted(SERVER_HALVES) == sorted(TRAINER_HALVES) == sorted(STEP_MODES)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_chained_steps_match_a_local_loop(make_engine, device):
    data = batches(4)
    ref_losses, ref_params = local_loop(data)
    engine, steps = make_engine(device=device)
    engine.trainer_joined("t")
    half = ChainedServer(engine)
    grad, losses = None, []
    for x, y in data:
        out = half.step("t", grad, x)
        assert out.device.type == "cpu"  # tensors cross the RPC boundary on the CPU
        loss, grad = output_grad(out, y)
        losses.append(loss)
    assert len(steps) == 3  # the last step's update is owed until the flush
    assert half.step("t", grad, None) is None  # the flush: gradient only
    assert steps == [(1, 8), (2, 8), (3, 8), (4, 8)]
    assert engine.samples_seen == 32
    assert losses == pytest.approx(ref_losses, rel=1e-5 if device == "cpu" else 1e-4)
    assert_same_weights(engine, ref_params, device)
    assert half.pending() == 0 and engine.wait_idle(0) == []


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_plain_steps_match_a_local_loop(make_engine, device):
    """forward, the backward through the returned output, and the gradient handed over as
    SharedOptimizer.step hands it (without RPC the output is still tied to the server's graph)."""
    data = batches(4)
    ref_losses, ref_params = local_loop(data)
    engine, steps = make_engine(device=device)
    engine.trainer_joined("t")
    half = PlainServer(engine)
    losses = []
    for x, y in data:
        out = half.forward("t", x)
        losses.append(backward_and_submit(engine, half, out, y))
    assert steps == [(1, 8), (2, 8), (3, 8), (4, 8)]
    assert losses == pytest.approx(ref_losses, rel=1e-5 if device == "cpu" else 1e-4)
    assert_same_weights(engine, ref_params, device)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_pull_steps_match_a_local_loop(make_engine, device):
    """Trainer compute: the model runs on the pulled parameters (without RPC still tied to the
    server's by autograd); their gradients reach the server's leaves and are submitted."""
    from torch.func import functional_call

    data = batches(4)
    ref_losses, ref_params = local_loop(data)
    engine, steps = make_engine(device=device)
    engine.trainer_joined("t")
    half = PullServer(engine)
    model = build_model("mlp")
    names = [n for n, _ in model.named_parameters()]
    losses = []
    for x, y in data:
        params = half.pull("t", int(x.shape[0]))
        assert all(p.grad_fn is not None for p in params)  # not leaves: RPC records only those
        out = functional_call(model, {n: p.cpu() for n, p in zip(names, params, strict=True)}, (x,))
        losses.append(backward_and_submit(engine, half, out, y))
    assert steps == [(1, 8), (2, 8), (3, 8), (4, 8)]
    assert losses == pytest.approx(ref_losses, rel=1e-5 if device == "cpu" else 1e-4)
    assert_same_weights(engine, ref_params, device)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_pushpull_steps_match_a_local_loop(make_engine, device):
    """Trainer compute in one round trip: each call pushes the last step's flat gradient and
    pulls the next step's flat parameters; a last call only pushes."""
    from torch.nn.utils import parameters_to_vector, vector_to_parameters

    data = batches(4)
    ref_losses, ref_params = local_loop(data)
    engine, steps = make_engine(device=device)
    engine.trainer_joined("t")
    half = PushPullServer(engine)
    assert half.join_info("t", join_request()) == {"shard_params": [len(engine.params)],
                                                  "transport": {"kind": "cpu", "reason": ""},
                                                  "overlap": {"on": False, "reason": "--overlap off"},
                                                  "parts": True}
    model = build_model("mlp", seed=7)  # the trainer's own initial weights are never used
    grads, losses = None, []
    for x, y in data:
        (flat,) = half.exchange("t", grads, int(x.shape[0]))
        assert flat.device.type == "cpu" and flat.numel() == engine.num_params
        vector_to_parameters(flat, model.parameters())
        loss = nn.functional.cross_entropy(model(x), y)
        grads = [parameters_to_vector(torch.autograd.grad(loss, list(model.parameters())))]
        losses.append(float(loss.detach()))
    assert len(steps) == 3
    assert half.exchange("t", grads, None) is None  # the flush
    assert steps == [(1, 8), (2, 8), (3, 8), (4, 8)]
    assert losses == pytest.approx(ref_losses, rel=1e-5 if device == "cpu" else 1e-4)
    assert_same_weights(engine, ref_params, device)
    half.exchange("t", None, 8)
    with pytest.raises(ValueError, match="gradient buffer of 3 values for shard 0"):
        half.exchange("t", [torch.zeros(3)], None)
    assert engine.wait_idle(0) == []  # the refused step was dropped, not left open


def test_a_rejoined_overlapping_trainers_first_call_counts_its_staleness_from_its_reply(make_engine):
    """After a rejoin the trainer's first call carries the gradient it owed (numbered: its step
    opens as it arrives) and brings the weights of its next step, which it computes on them:
    that step's update, with nothing landing between, has staleness 0 (it was counted from the
    owed gradient's arrival, 1)."""
    engine, _ = make_engine()
    half = PushPullServer(engine)
    engine.trainer_joined("t")
    assert half.join_info("t", join_request(overlap="on"))["overlap"]["on"]
    zero = [torch.zeros(engine.num_params)]
    half.exchange("t", zero, 8, done=8, number=5)  # owed from its last incarnation
    half.exchange("t", zero, 8, number=6)  # computed on the reply before: not overlapping yet
    assert engine.trainer_progress("t").staleness == 0
    half.exchange("t", zero, 8, number=7)  # overlapping: on the reply before the last
    assert engine.trainer_progress("t").staleness == 1
    half.exchange("t", zero, None, number=8)


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_pushpull_in_a_narrow_wire_dtype_keeps_fp32_master_weights(make_engine, wire):
    """Parameters go out and gradients come in as ``wire``; the server's weights and Adam state
    stay fp32, and the update is the fp32 update of the rounded gradient."""
    from psserver.common.transport import WIRE_DTYPES

    dtype = WIRE_DTYPES[wire]
    engine, _ = make_engine(optimizer="sgd", lr=0.1)
    engine.trainer_joined("t")
    half = PushPullServer(engine)
    half.join_info("t", join_request(wire_dtype=wire))
    (flat,) = half.exchange("t", None, 8)
    assert flat.dtype == dtype
    master = torch.cat([p.detach().reshape(-1) for p in engine.params])
    assert torch.equal(flat, master.to(dtype))
    grad = torch.randn(engine.num_params).to(dtype)
    half.exchange("t", [grad], None)
    after = torch.cat([p.detach().reshape(-1) for p in engine.params])
    assert all(p.dtype == torch.float32 for p in engine.params)
    assert torch.allclose(after, master - 0.1 * grad.float(), atol=1e-6)
    with pytest.raises(ValueError, match=r"dtype torch\.int64"):
        half.exchange("t", None, 8)
        half.exchange("t", [torch.zeros(engine.num_params, dtype=torch.long)], None)


def test_pulled_parameters_in_a_narrow_wire_dtype_stay_tied_to_the_fp32_weights(make_engine):
    engine, steps = make_engine(optimizer="sgd", lr=0.1)
    engine.trainer_joined("t")
    half = PullServer(engine)
    half.set_wire_dtype("t", "bf16")  # what its join does, without the RPC the join's RRefs need
    pulled = half.pull("t", 8)
    assert all(p.dtype == torch.bfloat16 and p.grad_fn is not None for p in pulled)
    sum(p.float().sum() for p in pulled).backward()  # the trainer's fp32 copies, then a loss
    grads = {p: p.grad for p in engine.params}
    assert all(g.dtype == torch.float32 and torch.all(g == 1) for g in grads.values())
    before = [p.detach().clone() for p in engine.params]
    half.submit("t", grads)
    assert steps == [(1, 8)]
    for p, b in zip(engine.params, before, strict=True):
        assert torch.allclose(p.detach(), b - 0.1, atol=1e-6)


def test_pulled_parameters_are_copies_when_another_update_can_land(make_engine):
    engine, _ = make_engine()
    for t in ("a", "b"):
        engine.trainer_joined(t)
    pulled = PullServer(engine).pull("a", 8)
    for p, q in zip(pulled, engine.params, strict=True):
        assert p.data_ptr() != q.data_ptr() and torch.equal(p, q)


def test_other_trainers_update_between_forward_and_backward_with_clones(make_engine):
    """Async, two trainers: B's update lands between A's forward and A's backward; A's update is
    the gradient of the weights A's forward saw."""
    engine, steps = make_engine(optimizer="sgd", lr=0.1)
    engine.trainer_joined("a")
    engine.trainer_joined("b")
    assert engine.needs_clone()
    half = ChainedServer(engine)
    (xa, ya), (xb, yb) = batches(2)
    ref = build_model("mlp", seed=0)
    nn.functional.cross_entropy(ref(xa), ya).backward()
    expected = [p.grad.clone() for p in ref.parameters()]
    out_a = half.step("a", None, xa)
    out_b = half.step("b", None, xb)
    half.step("b", output_grad(out_b, yb)[1], None)  # B's update is applied
    before = [p.detach().clone() for p in engine.params]
    half.step("a", output_grad(out_a, ya)[1], None)
    assert steps == [(1, 8), (2, 8)]
    for p, b, g in zip(engine.params, before, expected, strict=True):
        assert torch.allclose(p.detach(), b - 0.1 * g, atol=1e-6)


def test_dropped_given_up_and_unmatched_gradients(make_engine):
    engine, steps = make_engine()
    engine.trainer_joined("t")
    half = ChainedServer(engine)
    (x, _), = batches(1)
    out = half.step("t", None, x)
    half.trainer_gone("t", evicted=True)
    engine.trainer_gone("t")  # the trainer died: its step contributes nothing
    with pytest.raises(RuntimeError, match="no forward pending"):
        half.step("t", torch.ones_like(out), None)
    engine.trainer_joined("t")
    half.step("t", None, x)
    with pytest.raises(ValueError, match=r"output gradient of shape \(8, 2\) does not match the output \(8, 10\)"):
        half.step("t", torch.ones(8, 2), None)
    half.step("t", None, x)
    half.step("t", None, None)  # given up: dropped, no update
    assert steps == [] and half.pending() == 0 and engine.wait_idle(0) == []


def test_a_draining_engine_finishes_open_steps_and_refuses_new_ones(make_engine):
    engine, steps = make_engine()
    engine.trainer_joined("t")
    half = ChainedServer(engine)
    (x, y), = batches(1)
    out = half.step("t", None, x)
    engine.drain()
    assert engine.wait_idle(0.05) == ["t"]  # its step is open until its gradient arrives
    with pytest.raises(ShuttingDown):
        half.step("t", output_grad(out, y)[1], x)  # the update lands, the next forward is refused
    assert steps == [(1, 8)] and engine.wait_idle(0) == []


def test_sync_rounds_average_and_release_waiters(make_engine):
    """Two plain trainers in sync mode: one optimizer step per round, each trainer's next
    forward waits for the round its gradient belongs to."""
    import threading

    engine, steps = make_engine(update="sync", optimizer="sgd", lr=0.1)
    for t in ("a", "b"):
        engine.trainer_joined(t)
    half = PlainServer(engine)
    (xa, ya), (xb, yb) = batches(2)

    def grads_of(trainer, x, y):
        out = half.forward(trainer, x)
        nn.functional.cross_entropy(out, y).backward()
        g = {p: p.grad.clone() for p in engine.params}
        for p in engine.params:
            p.grad = None
        return g

    half.submit("a", grads_of("a", xa, ya))
    released = threading.Event()
    waiter = threading.Thread(target=lambda: (half.forward("a", xa), released.set()))
    waiter.start()
    assert not released.wait(0.3) and steps == []  # a's next forward waits for b
    half.submit("b", grads_of("b", xb, yb))
    assert released.wait(10)
    waiter.join()
    assert steps == [(1, 16)]


# ---- ssp through the one-round-trip protocols ------------------------------------------------


@pytest.mark.timeout(60)
def test_ssp_pushpull_waits_between_finishing_and_starting_at_the_bound():
    """S = 0 with two pushpull trainers: ``a``'s update lands at once, but its next pull waits
    (on the calling thread) until ``b`` asks for the same step; then both start it together."""
    import threading

    cfg = ServerConfig(model="mlp", update="ssp", staleness=0, devices=["cpu"],
                       optimizer=OptimizerConfig(name="sgd", lr=0.1))
    engine = StepEngine(cfg, resolve_devices(cfg.devices))
    try:
        steps: list[tuple[int, int]] = []
        engine.listeners.append(lambda step, samples: steps.append((step, samples)))
        half = PushPullServer(engine)
        for t in ("a", "b"):
            engine.trainer_joined(t)
            half.set_wire_dtype(t, "fp32")
        assert engine.needs_clone()  # every gradient lands as it arrives, as async
        zero = [torch.zeros(engine.num_params)]

        def in_background(trainer: str, grads) -> threading.Event:
            done = threading.Event()
            threading.Thread(target=lambda: (half.exchange(trainer, grads, 8), done.set()), daemon=True).start()
            return done

        def clocks() -> tuple[int, int]:
            return engine.trainer_progress("a").clock, engine.trainer_progress("b").clock

        half.exchange("a", None, 8)  # a takes part at clock 0 and starts its step 1 alone
        b_started = in_background("b", None)  # b enters at the slowest clock, 1, and asks for step 2:
        assert not b_started.wait(0.5)  # with S = 0 it waits for a to ask for step 2 too
        half.exchange("a", zero, 8)  # a asks: both start step 2 (a in one hand-off with its update)
        assert b_started.wait(10)
        assert clocks() == (2, 2)
        a_pulled = in_background("a", zero)  # a's update, then its step 3 waits for b to ask
        assert not a_pulled.wait(0.5)
        assert steps == [(1, 8), (2, 8)]  # a's update was applied all the same
        assert clocks() == (2, 2)
        half.exchange("b", zero, 8)
        assert a_pulled.wait(10)
        assert clocks() == (3, 3) and steps == [(1, 8), (2, 8), (3, 8)]
        a, b = engine.trainer_progress("a"), engine.trainer_progress("b")
        # a's step 2 opened after its own update of step 1 and before anyone else's landed;
        # b's step 2 opened before or after a's update of step 1 (the same instant for ssp),
        # and a's update of step 2 landed before b's.
        assert a.staleness == 0 and b.staleness in (1, 2) and b.max_staleness == b.staleness
        # b leaves: a is bounded by nobody and its next exchanges go in one hand-off.
        engine.trainer_gone("b")
        assert engine.try_start("a")  # granted: the next exchange's step opens on it
        half.exchange("a", zero, 8)
        half.exchange("a", zero, None)
        assert engine.trainer_progress("a").clock == 4 and engine.wait_idle(0) == []
        assert engine.trainer_progress("b").clock == 3  # as it left
    finally:
        engine.close()


@pytest.mark.timeout(60)
def test_ssp_plain_forward_waits_for_the_slowest_and_a_drain_releases_it():
    import threading

    cfg = ServerConfig(model="mlp", update="ssp", staleness=1, devices=["cpu"],
                       optimizer=OptimizerConfig(name="sgd", lr=0.1))
    engine = StepEngine(cfg, resolve_devices(cfg.devices))
    try:
        half = PlainServer(engine)
        for t in ("a", "b"):
            engine.trainer_joined(t)
        (x, y), = batches(1)
        half.forward("b", x)  # b takes part at clock 0, starts its step 1 alone and never ends it
        out = half.forward("a", x)  # a enters at b's clock, 1: its step 2 needs b at step 1
        nn.functional.cross_entropy(out, y).backward()
        half.submit("a", {p: p.grad for p in engine.params})
        refused = threading.Event()

        def third() -> None:
            try:
                half.forward("a", x)
            except ShuttingDown:
                refused.set()

        caller = threading.Thread(target=third)
        caller.start()
        assert not refused.wait(0.5)  # a's step 3 needs b at step 2
        engine.drain()  # the server stops: the waiter is released, its step refused
        assert refused.wait(10)
        caller.join()
    finally:
        engine.close()
