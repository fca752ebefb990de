"""Delayed Nesterov: period 1 is torch's Nesterov SGD; a whole window of N arrivals moves the
weights by one Nesterov step on the window's mean; between milestones each arrival moves them by
-lr * g / N; its state survives a state_dict round trip, as tensors."""

from __future__ import annotations

import torch

from psserver.config import OptimizerConfig
from psserver.config.optimizer import make_optimizer, optimizer_class
from psserver.optim import DelayedNesterov

LR, MU = 0.7, 0.9


def arrivals(n: int, size: int = 6, seed: int = 0) -> list[torch.Tensor]:
    """Float64, so that the comparisons measure the arithmetic, not fp32 rounding in another order."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=g, dtype=torch.float64) for _ in range(n)]


def start_point(seed: int = 100) -> torch.Tensor:
    return torch.randn(6, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def run(opt_cls, start: torch.Tensor, grads: list[torch.Tensor], **kw) -> tuple[torch.Tensor, torch.optim.Optimizer]:
    p = torch.nn.Parameter(start.clone())
    opt = opt_cls([p], **kw)
    trace = []
    for g in grads:
        p.grad = g.clone()
        opt.step()
        trace.append(p.detach().clone())
    return torch.stack(trace), opt


def test_period_one_is_torch_nesterov_sgd():
    grads, start = arrivals(7), start_point()
    ours, _ = run(DelayedNesterov, start, grads, lr=LR, momentum=MU, period=1)
    torch_, _ = run(torch.optim.SGD, start, grads, lr=LR, momentum=MU, nesterov=True)
    assert (ours - torch_).abs().max() <= 1e-6


def test_a_window_is_one_nesterov_step_on_its_mean_and_between_milestones_plain_sgd_over_n():
    n, windows = 3, 3
    grads, start = arrivals(n * windows, seed=1), start_point()
    ours, _ = run(DelayedNesterov, start, grads, lr=LR, momentum=MU, period=n)
    means = [torch.stack(grads[w * n:(w + 1) * n]).mean(0) for w in range(windows)]
    at_milestones, _ = run(torch.optim.SGD, start, means, lr=LR, momentum=MU, nesterov=True)
    assert (ours[n - 1::n] - at_milestones).abs().max() <= 1e-6
    before = start
    for t, g in enumerate(grads):
        if (t + 1) % n:
            assert (ours[t] - (before - LR * g / n)).abs().max() <= 1e-6
        before = ours[t]


def test_its_state_is_tensors_and_survives_a_state_dict_round_trip():
    n = 3
    grads, start = arrivals(8, seed=2), start_point()
    whole, _ = run(DelayedNesterov, start, grads, lr=LR, momentum=MU, period=n)
    first, opt = run(DelayedNesterov, start, grads[:4], lr=LR, momentum=MU, period=n)
    state = opt.state_dict()
    assert all(isinstance(v, torch.Tensor) for s in state["state"].values() for v in s.values())
    assert int(state["state"][0]["arrivals"]) == 4
    p = torch.nn.Parameter(first[-1].clone())
    again = DelayedNesterov([p], lr=LR, momentum=MU, period=n)
    again.load_state_dict(state)
    for g in grads[4:]:
        p.grad = g.clone()
        again.step()
    assert torch.equal(p.detach(), whole[-1])


def test_the_server_takes_it_by_name_with_its_period():
    assert optimizer_class("delayed_nesterov") is DelayedNesterov
    config = OptimizerConfig(name="delayed_nesterov", lr=LR, momentum=MU, args={"period": 4})
    opt = make_optimizer([torch.nn.Parameter(torch.zeros(2))], config, fused=True)
    assert isinstance(opt, DelayedNesterov) and opt.param_groups[0]["period"] == 4
