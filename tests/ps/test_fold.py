"""``--step fold`` in-process: the taps hand the server's backward gradients to one step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psserver.config import OptimizerConfig, TrainerConfig
from psserver.ps.fold import FoldedStep
from psserver.ps.shard import Shard
from psserver.ps.updates import AsyncUpdater


def make_shard(module: nn.Module) -> Shard:
    torch.manual_seed(0)
    shard = Shard(0, module, torch.device("cpu"))
    shard.init_optimizer(OptimizerConfig(name="sgd", lr=0.5))
    return shard


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def reference_grads(x, y):
    model = mlp()
    nn.functional.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("clone", [False, True])
def test_fold_submits_the_whole_gradient_when_backward_ends(clone):
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    expected = reference_grads(x, y)
    shard = make_shard(mlp())
    before = [p.detach().clone() for p in shard.params]
    submitted = []
    up = AsyncUpdater([shard], lambda s, n: None)

    def submit(grads, samples):
        submitted.append(({p: g.clone() for p, g in grads.items()}, samples))
        up.submit("t", grads, samples)

    step = FoldedStep(len(shard.params), 8, submit)
    out = shard.forward(x, clone=clone, fold=step)
    nn.functional.cross_entropy(out, y).backward()
    # Submitted once, inside backward, with every parameter's gradient, and applied.
    assert len(submitted) == 1 and submitted[0][1] == 8
    grads = submitted[0][0]
    for p, g_ref, b in zip(shard.params, expected, before):
        assert torch.allclose(grads[p], g_ref, atol=1e-6)
        assert torch.allclose(p.detach(), b - 0.5 * g_ref, atol=1e-6)
        assert p.grad is None  # nothing flowed on to the leaf (no second copy of the gradient)
    assert step.flush() is False  # complete: nothing owed


def test_fold_with_clone_survives_an_update_between_forward_and_backward():
    """Two trainers: another's step lands between this forward and its backward."""
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    expected = reference_grads(x, y)
    shard = make_shard(mlp())
    got = []
    step = FoldedStep(len(shard.params), 8, lambda grads, n: got.append(grads))
    out = shard.forward(x, clone=True, fold=step)
    shard.apply({p: torch.ones_like(p) for p in shard.params})  # the other trainer's update
    nn.functional.cross_entropy(out, y).backward()
    # The gradient is the one of the weights this forward saw.
    assert all(torch.allclose(got[0][p], g, atol=1e-6) for p, g in zip(shard.params, expected))


def test_unused_parameter_leaves_the_step_to_flush():
    class WithSpare(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(4, 2)
            self.spare = nn.Linear(4, 2)

        def forward(self, x):
            return self.used(x)

    shard = make_shard(WithSpare())
    got = []
    step = FoldedStep(len(shard.params), 4, lambda grads, n: got.append((set(grads), n)))
    shard.forward(torch.randn(4, 4), clone=False, fold=step).sum().backward()
    assert got == []  # two parameters never reported
    assert step.flush() is True
    assert got == [({shard.module.used.weight, shard.module.used.bias}, 4)]
    assert step.flush() is False  # submitted once only


def test_step_modes_are_checked():
    assert TrainerConfig(step="fold").step == "fold"
    with pytest.raises(ValueError, match="--step must be one of plain, fold, chained, fused"):
        TrainerConfig(step="folded")
