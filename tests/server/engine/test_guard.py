"""The gradient guard and the updaters' dropped steps, without RPC."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psserver.common.tensors import total_norm
from psserver.config import OptimizerConfig
from psserver.server.engine.engine import make_updater
from psserver.server.engine.guard import GradientGuard
from psserver.server.engine.shard import Shard


def _grads(model: nn.Module, scale: float = 1.0) -> dict[nn.Parameter, torch.Tensor]:
    torch.manual_seed(0)
    return {p: torch.randn_like(p) * scale for p in model.parameters()}


def test_total_norm_is_the_norm_of_all_gradients_together():
    gs = [torch.randn(3, 4), torch.randn(7), torch.randn(2, 2).to(torch.bfloat16)]
    expected = torch.linalg.vector_norm(torch.cat([g.float().reshape(-1) for g in gs]))
    assert total_norm(gs) == pytest.approx(float(expected), rel=1e-5)
    assert total_norm([]) == 0.0


def test_clipping_matches_clip_grad_norm():
    model = nn.Linear(8, 4)
    grads = _grads(model, scale=10.0)
    guard = GradientGuard(max_norm=1.0, max_nonfinite=3)
    clipped = guard.check("t", grads)
    for p, g in grads.items():
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    for p in model.parameters():
        torch.testing.assert_close(clipped[p], p.grad)
    assert guard.counts("t").clipped == 1 and guard.clipped_total == 1
    small = _grads(model, scale=1e-4)
    assert guard.check("t", small) is small  # under the bound: untouched, not copied


def test_partitions_of_one_gradient_are_clipped_and_dropped_alike_with_its_whole_norm():
    """Several server processes: each holds a partition of the gradient; with the whole
    gradient's norm (the trainer sends it) every server clips by the same factor, which is
    clip_grad_norm_ over the whole model, and drops a step that is not finite anywhere."""
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 2))
    grads = _grads(model, scale=10.0)
    params = list(model.parameters())
    whole = total_norm(list(grads.values()))
    parts = [{p: grads[p] for p in params[:2]}, {p: grads[p] for p in params[2:]}]
    guards = [GradientGuard(max_norm=1.0, max_nonfinite=3) for _ in parts]
    clipped = {}
    for guard, part in zip(guards, parts, strict=True):
        clipped.update(guard.check("t", part, whole))
    for p, g in grads.items():
        p.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    for p in params:
        torch.testing.assert_close(clipped[p], p.grad)
    # A NaN on server 1's partition only: server 0 drops its (finite) part too.
    assert guards[0].check("t", parts[0], float("nan")) is None
    assert guards[0].counts("t").nonfinite == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_gradient_is_refused_and_counted_in_a_row(bad):
    model = nn.Linear(8, 4)
    guard = GradientGuard(max_norm=None, max_nonfinite=2)
    poisoned = _grads(model)
    next(iter(poisoned.values()))[0, 0] = bad
    assert guard.check("t", poisoned) is None
    assert guard.must_evict("t") is None
    assert len(guard.take_notices("t")) == 1 and guard.take_notices("t") == []
    assert guard.check("t", _grads(model)) is not None  # a finite one resets the streak
    assert guard.check("t", poisoned) is None and guard.check("t", poisoned) is None
    assert "sent 2 non-finite gradients in a row" in guard.must_evict("t")
    c = guard.counts("t")
    assert (c.nonfinite, c.streak, guard.nonfinite_total) == (3, 2, 3)
    guard.forget("t")
    assert guard.must_evict("t") is None and guard.take_notices("t") == []
    assert guard.counts("t").nonfinite == 3  # kept for status


def test_a_finite_norm_said_for_a_non_finite_gradient_lets_nothing_in():
    """The whole step's norm comes from the trainer (several servers): a partition with NaN in
    it is dropped whatever norm it came with."""
    model = nn.Linear(8, 4)
    guard = GradientGuard(max_norm=None, max_nonfinite=3)
    poisoned = _grads(model)
    next(iter(poisoned.values()))[0, 0] = float("nan")
    assert guard.check("t", poisoned, norm=1.0) is None
    assert guard.counts("t").nonfinite == 1


def _shard() -> Shard:
    s = Shard(0, nn.Linear(4, 2), torch.device("cpu"))
    s.init_optimizer(OptimizerConfig(name="sgd", lr=0.1))
    return s


def test_async_dropped_step_changes_nothing():
    shard = _shard()
    steps = []
    up = make_updater("async", [shard], lambda step, samples: steps.append(step), 2, 0)
    before = [p.detach().clone() for p in shard.params]
    up.trainer_joined("a")
    up.step_opened("a")
    up.submit("a", None, 8)
    assert up.global_step == 0 and steps == []
    assert all(torch.equal(a, b) for a, b in zip(before, shard.params, strict=True))
    assert up.progress("a").done == 1 and up.progress("a").updates == 0  # ended, nothing applied
    up.step_opened("a")
    up.submit("a", {p: torch.ones_like(p) for p in shard.params}, 8)
    assert up.global_step == 1 and steps == [1] and up.progress("a").updates == 1


def test_sync_round_averages_only_the_finite_gradients_and_a_dropped_round_only_ends():
    shard = _shard()
    reported = []
    up = make_updater("sync", [shard], lambda step, samples: reported.append((step, samples)), 2, 0)
    for t in ("a", "b"):
        up.trainer_joined(t)
        up.step_opened(t)
    g = {p: torch.ones_like(p) for p in shard.params}
    before = [p.detach().clone() for p in shard.params]
    up.submit("a", g, 8)
    up.submit("b", None, 8)  # arrived, dropped: the round completes with a's gradient alone
    assert reported == [(1, 8)]
    for p, b in zip(shard.params, before, strict=True):
        torch.testing.assert_close(p.detach(), b - 0.1)  # not halved by the dropped one
    up.wait_turn("a", timeout=1)  # the round is applied: nobody waits
    for t in ("a", "b"):
        up.step_opened(t)
        up.submit(t, None, 8)
    assert up.global_step == 1 and reported == [(1, 8)]  # a round of dropped steps: no update
    up.wait_turn("b", timeout=1)  # but it ended
