"""``psserver.DistributedOptimizer`` on its own: what it counts, when it sends, and AMP's
GradScaler around it. The connection is a stand-in that records the steps it is asked for
(the wrapper against a real server: ``test_library.py``). And what a user's own
``torch.distributed.optim.DistributedOptimizer`` (the RPC tutorial's loop) makes of the
server's optimizer, on an engine in this process."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn
from torch.distributed.optim.functional_sgd import _FunctionalSGD

import psserver
from psserver.config import LRScheduleConfig, OptimizerConfig, ServerConfig
from psserver.server.engine.engine import StepEngine
from psserver.server.steps.plain import PlainServer


class Recorder:
    """What the wrapper uses of a connection: the replica, the server's lr, step()."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.lr = 0.5
        self.sent: list[dict[str, torch.Tensor]] = []

    def step(self, *, samples=None, loss=None) -> None:
        self.sent.append({n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None})
        for p in self.model.parameters():
            p.grad = None
        self.lr = 0.25  # the server's schedule moved


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def test_k_backward_passes_then_one_step_send_their_sum_once():
    ps = Recorder(model())
    opt = psserver.DistributedOptimizer(ps, ps.model.named_parameters(), backward_passes_per_step=2)
    assert opt.param_groups[0]["lr"] == 0.5
    x = torch.randn(4, 3)
    for half in x.chunk(2):
        ps.model(half).sum().backward()
    opt.step()
    assert len(ps.sent) == 1
    assert torch.allclose(ps.sent[0]["weight"], torch.autograd.functional.jacobian(
        lambda w: (x @ w.T).sum(), ps.model.weight.detach()))
    assert opt.param_groups[0]["lr"] == 0.25  # mirrors the server after every step


def test_more_passes_than_declared_is_horovods_error():
    ps = Recorder(model())
    opt = psserver.DistributedOptimizer(ps, ps.model.named_parameters(), backward_passes_per_step=2)
    for _ in range(2):
        ps.model(torch.randn(2, 3)).sum().backward()
    with pytest.raises(psserver.UsageError, match=r"computed 3 times before DistributedOptimizer\.step"):
        ps.model(torch.randn(2, 3)).sum().backward()
    opt.zero_grad()
    ps.model(torch.randn(2, 3)).sum().backward()  # counting starts again
    opt.step()


def test_setting_lr_locally_warns_that_the_servers_applies(caplog):
    ps = Recorder(model())
    opt = psserver.DistributedOptimizer(ps, ps.model.parameters())
    opt.param_groups[0]["lr"] = 3.0
    ps.model(torch.randn(2, 3)).sum().backward()
    with caplog.at_level(logging.WARNING):
        opt.step()
    assert "the server's learning rate applies" in caplog.text


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_backward_passes_must_be_a_positive_int(bad):
    ps = Recorder(model())
    with pytest.raises(psserver.UsageError, match="backward_passes_per_step"):
        psserver.DistributedOptimizer(ps, ps.model.parameters(), backward_passes_per_step=bad)


def test_parameters_of_another_model_are_refused():
    ps = Recorder(model())
    with pytest.raises(psserver.UsageError, match="the replica's parameters"):
        psserver.DistributedOptimizer(ps, nn.Linear(3, 2).named_parameters())


def test_the_amp_loop_sends_unscaled_clipped_gradients_and_skips_non_finite_ones():
    ps = Recorder(model())
    opt = psserver.DistributedOptimizer(ps, ps.model.named_parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    x = torch.randn(8, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ps.model(x).float().pow(2).sum()
    scaler.scale(loss).backward()
    opt.synchronize()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(ps.model.parameters(), 1.0)
    with opt.skip_synchronize():
        scaler.step(opt)
    scaler.update()
    sent = ps.sent[0]
    assert math.isclose(math.sqrt(sum(float(g.pow(2).sum()) for g in sent.values())), 1.0, rel_tol=1e-4)
    ps.model.weight.grad = torch.full_like(ps.model.weight, math.inf)  # an overflow: the scaler skips the step
    ps.model.bias.grad = torch.zeros_like(ps.model.bias)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert len(ps.sent) == 1 and scaler.get_scale() < 1024.0


def test_a_new_wrapper_replaces_the_hooks_of_the_one_before():
    ps = Recorder(model())
    psserver.DistributedOptimizer(ps, ps.model.named_parameters())
    opt = psserver.DistributedOptimizer(ps, ps.model.named_parameters(), backward_passes_per_step=2)
    for _ in range(2):  # the first one's hooks would refuse the second pass
        ps.model(torch.randn(2, 3)).sum().backward()
    with pytest.raises(psserver.UsageError, match=r"computed 3 times .*\(backward_passes_per_step=2\)"):
        ps.model(torch.randn(2, 3)).sum().backward()
    opt.zero_grad()
    ps.model(torch.randn(2, 3)).sum().backward()
    opt.step()
    assert len(ps.sent) == 1


def test_a_subset_of_the_parameters_is_refused():
    ps = Recorder(model())
    with pytest.raises(psserver.UsageError, match=r"not bias: psserver's optimizer is the server's, over the whole "
                                                  r"model: pass model\.named_parameters\(\)"):
        psserver.DistributedOptimizer(ps, [("weight", ps.model.weight)])
    with pytest.raises(psserver.UsageError, match="no parameter groups"):
        psserver.DistributedOptimizer(ps, [{"params": list(ps.model.parameters()), "lr": 0.1}])
    ps.model.bias.requires_grad_(False)  # frozen: the names cover every parameter that trains
    psserver.DistributedOptimizer(ps, [("weight", ps.model.weight)])


# ---- a user's own torch.distributed.optim.DistributedOptimizer (the RPC tutorial's loop) ---------


@pytest.fixture
def engine_of():
    """A server's engine (model mlp, on the CPU) and its RRef path's half, as ``psserver serve``
    with ``optimizer`` (None: no ``--optimizer``) and the other ``config`` holds them."""

    engines = []

    def make(optimizer: OptimizerConfig | None = None, **config):
        engine = StepEngine(ServerConfig(model="mlp", devices=["cpu"], optimizer=optimizer, **config),
                            [torch.device("cpu")])
        engines.append(engine)
        engine.agree_optimizer(None, "trainer_0_0")  # the tutorial's trainer joins naming none
        return engine, PlainServer(engine)

    yield make
    for engine in engines:
        engine.close()


def one_update(engine) -> None:
    engine.trainer_joined("t")
    engine.open_step("t", 4)
    engine.submit("t", {p: torch.zeros_like(p) for p in engine.trainable})


def test_the_tutorials_optimizer_sets_a_server_started_without_one(engine_of):
    engine, plain = engine_of()
    assert engine.optimizer_config == OptimizerConfig()  # the default adam, until a trainer names one
    plain.agree_named_optimizer(torch.optim.SGD, (), {"lr": 0.03})
    assert engine.optimizer_config == OptimizerConfig("sgd", 0.03)
    shard_optimizer = engine.shards[0].optimizer
    assert isinstance(shard_optimizer, torch.optim.SGD) and shard_optimizer.param_groups[0]["lr"] == 0.03
    # The second trainer names the same one: the functional twin DistributedOptimizer sends,
    # its lr positional, an implementation flag that changes nothing.
    assert plain.agree_named_optimizer(_FunctionalSGD, (0.03,), {"foreach": True}).startswith("sgd(lr=0.03")
    one_update(engine)
    with pytest.raises(ValueError, match=r"names sgd\(lr=0\.05.*this server trains with sgd\(lr=0\.03.*first "
                                         r"trainer's choice"):
        plain.agree_named_optimizer(torch.optim.SGD, (), {"lr": 0.05})
    assert engine.shards[0].optimizer is shard_optimizer


def test_another_optimizer_than_the_servers_is_refused_in_one_line(engine_of, caplog):
    engine, plain = engine_of(OptimizerConfig("adam", 1e-3))  # psserver serve --optimizer adam
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError) as refused:
        plain.agree_named_optimizer(torch.optim.SGD, (), {"lr": 0.03})
    assert "\n" not in str(refused.value)
    assert "names sgd(lr=0.03" in str(refused.value) and "trains with adam(lr=0.001" in str(refused.value)
    assert "refused a trainer's DistributedOptimizer" in caplog.text
    assert engine.optimizer_config == OptimizerConfig("adam", 1e-3)
    plain.agree_named_optimizer(torch.optim.Adam, (), {})  # the server's own: fine
    plain.agree_named_optimizer(torch.optim.Adam, (), {"lr": 1e-3, "betas": (0.9, 0.999)})


def test_a_default_that_has_trained_already_is_kept_and_the_other_optimizer_refused(engine_of):
    engine, plain = engine_of()
    one_update(engine)  # a trainer of ps.replica stepped with the default
    with pytest.raises(ValueError, match=r"adam\(lr=0\.001.*\(its default, which 1 updates have used: name it, or "
                                         r"name yours before any step\)"):
        plain.agree_named_optimizer(torch.optim.SGD, (), {"lr": 0.03})
    assert engine.optimizer_config == OptimizerConfig()


def test_an_optimizer_the_servers_lr_schedule_cannot_take_is_refused_and_nothing_changes(engine_of):
    schedule = LRScheduleConfig("OneCycleLR", {"max_lr": 0.1, "total_steps": 100})
    engine, plain = engine_of(lr_schedule=schedule)
    with pytest.raises(ValueError, match=r"names adagrad\(lr=0\.01.*: .*optimizer must support momentum"):
        plain.agree_named_optimizer(torch.optim.Adagrad, (), {})
    assert engine.optimizer_config == OptimizerConfig() and isinstance(engine.shards[0].optimizer, torch.optim.Adam)
    plain.agree_named_optimizer(torch.optim.SGD, (), {"lr": 0.03, "momentum": 0.9})
    assert engine.optimizer_config == OptimizerConfig("sgd", 0.03, momentum=0.9)


def test_an_optimizer_the_server_cannot_build_is_refused(engine_of):
    engine, plain = engine_of()
    with pytest.raises(ValueError, match=r"SGD with arguments it refuses: .*momentum"):
        plain.agree_named_optimizer(torch.optim.SGD, (), {"lr": 0.03, "momentum": -1.0})
    with pytest.raises(ValueError, match=r"lbfgs is not supported: it re-evaluates the loss"):
        plain.agree_named_optimizer(torch.optim.LBFGS, (), {})
    with pytest.raises(ValueError, match=r"torch\.optim optimizers only"):
        plain.agree_named_optimizer(Recorder, (), {})
    assert engine.optimizer_config == OptimizerConfig()


def test_outputs_that_grow_by_orders_of_magnitude_are_told_once_in_the_servers_log(engine_of, caplog):
    """The RPC path's loss stays on the trainer: the server watches the outputs it returns."""
    engine, plain = engine_of()
    engine.trainer_joined("t")
    x = torch.randn(4, 1, 28, 28)

    def forward() -> None:
        plain.forward("t", x)
        engine.drop_step("t")

    with caplog.at_level(logging.WARNING, logger="psserver.server.steps.plain"):
        forward()
        with torch.no_grad():
            engine.shards[0].module[-1].weight.mul_(10.0)  # tenfold: training's own range
        forward()
        assert caplog.records == []
        with torch.no_grad():
            engine.shards[0].module[-1].weight.mul_(1e5)
        forward()
        forward()
    told = [r.getMessage() for r in caplog.records]
    assert len(told) == 1 and "the largest of the model's outputs is" in told[0], told
    assert "training is diverging" in told[0] and "(global step 0)" in told[0]
