"""Delayed Nesterov momentum: the outer optimizer of asynchronous DiLoCo.

Applied on arrival, each trainer's pseudo-gradient would take a whole Nesterov step, and the
momentum would amplify the stale ones (Liu et al., 2024, "Asynchronous Local-SGD Training for
Language Modeling", Algorithm 3). Delayed Nesterov keeps the momentum still for ``period``
arrivals (N, by default the number of trainers K): each arrival ``g_t`` moves the weights by
``-lr * g_t / N``; every N-th also updates the momentum with the mean of the window's N
pseudo-gradients, ``m <- momentum * m + sum(g) / N``, and moves by ``-lr * momentum * m``. Over a
whole window the weights move by ``-lr * (mean(g) + momentum * m)``: one Nesterov step on the
window's mean, spread over its arrivals. ``period=1`` is ``torch.optim.SGD(nesterov=True)``.

Its state is tensors only (the momentum, the window's sum, the count of arrivals), updated in
place, so a checkpoint and the server's state in shared memory carry it whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class DelayedNesterov(torch.optim.Optimizer):
    """Each ``step()`` is one arrival (one pseudo-gradient in ``.grad``); see the module."""

    def __init__(self, params: Iterable, lr: float = 0.7, momentum: float = 0.0, period: int = 1,
                 weight_decay: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"period must be an int >= 1, got {period!r}")
        if weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "period": period, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, mu, n, wd = group["lr"], group["momentum"], group["period"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad if wd == 0 else p.grad.add(p, alpha=wd)
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["delta_sum"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["arrivals"] = torch.zeros((), dtype=torch.int64, device=p.device)
                arrivals, total, m = state["arrivals"], state["delta_sum"], state["momentum_buffer"]
                arrivals.add_(1)
                total.add_(g)
                p.add_(g, alpha=-lr / n)
                if int(arrivals) % n == 0:  # the window's last arrival: the momentum takes its mean
                    m.mul_(mu).add_(total, alpha=1.0 / n)
                    p.add_(m, alpha=-lr * mu)
                    total.zero_()
        return loss
