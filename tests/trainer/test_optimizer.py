"""``psserver.DistributedOptimizer`` on its own: what it counts, when it sends, and AMP's
GradScaler around it. The connection is a stand-in that records the steps it is asked for
(the wrapper against a real server: ``test_library.py``)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

import psserver


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
