"""``--step chained`` in-process: one call = last step's backward + update + next forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psserver.config import OptimizerConfig
from psserver.ps.chain import Chains
from psserver.ps.shard import Shard
from psserver.ps.updates import AsyncUpdater


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def server(optimizer: str = "adam", device: str = "cpu"):
    shard = Shard(0, mlp(), torch.device(device))
    shard.init_optimizer(OptimizerConfig(name=optimizer, lr=0.1))
    steps = []
    updater = AsyncUpdater([shard], lambda step, samples: steps.append((step, samples)))
    return shard, Chains(shard.params, updater.submit), steps


def call(shard: Shard, chains: Chains, name: str, grad_out, x, clone: bool = False):
    """What ParameterServer.chained_step does, without the RPC layer (CPU at the boundary)."""
    chains.backward(name, grad_out)
    if x is None:
        return None
    out = shard.forward(x, clone=clone)
    chains.hold(name, out, int(x.shape[0]))
    return out.detach().to("cpu")


def trainer_side(out: torch.Tensor, y: torch.Tensor) -> tuple[float, torch.Tensor]:
    out = out.clone().requires_grad_(True)
    loss = nn.functional.cross_entropy(out, y)
    (g,) = torch.autograd.grad(loss, (out,))
    return float(loss.detach()), g


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda:0", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs a CUDA GPU (none visible)")]),
])
def test_chained_steps_match_a_local_loop(device):
    """Same losses and weights as forward/backward/step in one process (Adam, 4 steps)."""
    batches = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(4)]
    ref = mlp()
    opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    ref_losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        ref_losses.append(float(loss.detach()))

    shard, chains, steps = server(device=device)
    grad, losses = None, []
    for x, y in batches:
        out = call(shard, chains, "t", grad, x)
        loss, grad = trainer_side(out, y)
        losses.append(loss)
    assert len(steps) == 3  # the last step's update is owed until the flush
    call(shard, chains, "t", grad, None)  # the flush: gradient only
    assert steps == [(1, 8), (2, 8), (3, 8), (4, 8)]
    assert losses == pytest.approx(ref_losses, rel=1e-5 if device == "cpu" else 1e-4)
    for p, q in zip(shard.params, ref.parameters()):
        assert p.device == torch.device(device)
        assert torch.allclose(p.detach().cpu(), q.detach(), atol=1e-5 if device == "cpu" else 1e-4)
    assert len(chains) == 0


def test_other_trainers_update_between_forward_and_backward_with_clones():
    """Async, two trainers: B's update lands between A's forward and A's backward."""
    shard, chains, steps = server("sgd")
    xa, ya = torch.randn(8, 6), torch.randint(0, 3, (8,))
    xb, yb = torch.randn(4, 6), torch.randint(0, 3, (4,))
    ref = mlp()
    nn.functional.cross_entropy(ref(xa), ya).backward()
    expected = [p.grad.clone() for p in ref.parameters()]
    out_a = call(shard, chains, "a", None, xa, clone=True)
    out_b = call(shard, chains, "b", None, xb, clone=True)
    call(shard, chains, "b", trainer_side(out_b, yb)[1], None, clone=True)  # B's update is applied
    before = [p.detach().clone() for p in shard.params]
    call(shard, chains, "a", trainer_side(out_a, ya)[1], None, clone=True)
    assert steps == [(1, 4), (2, 8)]
    # A's update is the gradient of the weights A's forward saw (SGD lr 0.1: w - 0.1 g).
    for p, b, g in zip(shard.params, before, expected):
        assert torch.allclose(p.detach(), b - 0.1 * g, atol=1e-6)


def test_dropped_and_unmatched_gradients_are_refused():
    shard, chains, steps = server()
    x = torch.randn(8, 6)
    out = call(shard, chains, "t", None, x)
    assert chains.drop("t") is True  # the trainer died: its step contributes nothing
    with pytest.raises(RuntimeError, match="no forward pending"):
        chains.backward("t", torch.ones_like(out))
    call(shard, chains, "t", None, x)
    with pytest.raises(ValueError, match=r"output gradient of shape \(8, 2\) does not match the output \(8, 3\)"):
        chains.backward("t", torch.ones(8, 2))
    call(shard, chains, "t", None, x)
    chains.backward("t", None)  # given up: dropped, no update
    assert steps == [] and len(chains) == 0
