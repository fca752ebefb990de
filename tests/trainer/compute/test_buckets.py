"""Gradient buckets (``psserver.trainer.compute.buckets``): which parameters share a bucket, and a
flat gradient filled from autograd hooks while backward runs that equals the gradient packed
after it. Device-independent: the same hooks run on a GPU's backward."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from psserver.trainer.compute.buckets import FIRST_BUCKET_BYTES, GradBuckets, assign_buckets


def test_buckets_start_from_the_last_parameters_and_tile_the_model():
    numels = [100, 300_000, 10, 250_000, 4, 2_000_000, 7]  # fp32: 0.4 KB ... 8 MB
    cap = 2 * FIRST_BUCKET_BYTES
    buckets = assign_buckets(numels, 4, cap)
    assert buckets[0].stop == len(numels)  # backward's first gradients: the last layer's
    assert sorted(i for r in buckets for i in r) == list(range(len(numels)))
    for earlier, later in itertools.pairwise(buckets):
        assert later.stop == earlier.start  # contiguous runs, from the end: one slice each
    sizes = [sum(numels[i] for i in r) * 4 for r in buckets]
    assert sizes[0] <= FIRST_BUCKET_BYTES or len(buckets[0]) == 1
    for r, size in zip(buckets[1:], sizes[1:], strict=True):
        assert size <= cap or len(r) == 1  # a parameter over the cap is a bucket of its own
    assert [5] in [list(r) for r in buckets]  # the 8 MB one
    assert assign_buckets([], 4, cap) == []
    assert assign_buckets([10, 10], 2, 1 << 30) == [range(2)]  # everything fits the first bucket
    with pytest.raises(ValueError):
        assign_buckets([1], 4, 0)


class Tied(nn.Module):
    """A weight used twice (its gradient is the sum of both uses), and one that backward never reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 6, bias=False)
        self.mid = nn.Linear(6, 32)
        self.out = nn.Linear(32, 3)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        h = self.embed(torch.relu(self.embed(x)))
        return self.out(torch.relu(self.mid(h)))


def grads_after(model, x, y) -> list[torch.Tensor]:
    loss = nn.functional.cross_entropy(model(x), y)
    got = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(model.parameters(), got, strict=True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hooks_fill_the_flat_gradient_as_backward_runs(dtype):
    torch.manual_seed(0)
    model = Tied()
    params = list(model.parameters())
    ready: list[tuple[int, int]] = []
    buckets = GradBuckets(params, dtype, "cpu", cap_bytes=64 * 4, on_ready=lambda a, b: ready.append((a, b)))
    assert len(buckets) > 2
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))
    expected = torch.cat([g.reshape(-1) for g in grads_after(model, x, y)]).to(dtype)
    buckets.flat.fill_(float("nan"))  # whatever the last step left
    buckets.arm()
    loss = nn.functional.cross_entropy(model(x), y)
    torch.autograd.grad(loss, params, allow_unused=True)
    during = len(ready)
    assert 0 < during < len(buckets)  # handed on during backward; the one with the unused layer waits for finish
    flat = buckets.finish()
    assert flat is buckets.flat and torch.equal(flat, expected)  # the tied weight's sum; unused: zeros
    assert sorted(ready) == [(buckets.offsets[r.start], buckets.offsets[r.stop]) for r in reversed(buckets.buckets)]


def test_frozen_and_unused_parameters_are_missing_and_one_unfrozen_later_is_filled():
    # a frozen layer takes no hook (torch refuses one); fine-tuning unfreezes it after a while
    model = Tied()
    params = list(model.parameters())
    model.mid.requires_grad_(False)
    buckets = GradBuckets(params, torch.float32, "cpu", cap_bytes=1 << 20)
    names = [n for n, _ in model.named_parameters()]
    x, y = torch.randn(5, 6), torch.randint(0, 3, (5,))

    def backward():
        buckets.arm()
        loss = nn.functional.cross_entropy(model(x), y)
        torch.autograd.grad(loss, [p for p in params if p.requires_grad], allow_unused=True)
        return buckets.finish()

    backward()
    assert [names[i] for i in buckets.missing] == ["mid.weight", "mid.bias", "unused.weight", "unused.bias"]
    model.mid.requires_grad_(True)
    flat = backward()
    assert [names[i] for i in buckets.missing] == ["unused.weight", "unused.bias"]
    expected = torch.cat([g.reshape(-1) for g in grads_after(model, x, y)])
    assert torch.equal(flat, expected)


def test_outside_arm_and_finish_the_hooks_do_nothing():
    model = Tied()
    buckets = GradBuckets(list(model.parameters()), torch.float32, "cpu", cap_bytes=1 << 20)
    buckets.flat.fill_(3.0)
    nn.functional.cross_entropy(model(torch.randn(2, 6)), torch.tensor([0, 1])).backward()  # a user's own
    assert bool((buckets.flat == 3.0).all())
    with pytest.raises(RuntimeError, match="without arm"):
        buckets.finish()
    buckets.remove()
    buckets.arm()
    nn.functional.cross_entropy(model(torch.randn(2, 6)), torch.tensor([0, 1])).backward()
    assert bool((buckets.finish() == 0).all())  # hooks removed: nothing filled, every slice zeroed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible)")
def test_on_the_gpu_buckets_fill_during_a_cuda_backward():
    torch.manual_seed(0)
    model = Tied().cuda()
    params = list(model.parameters())
    x, y = torch.randn(64, 6, device="cuda"), torch.randint(0, 3, (64,), device="cuda")
    expected = torch.cat([g.reshape(-1) for g in grads_after(model, x, y)]).to(torch.bfloat16)
    buckets = GradBuckets(params, torch.bfloat16, "cuda", cap_bytes=64 * 2)
    buckets.arm()
    torch.autograd.grad(nn.functional.cross_entropy(model(x), y), params, allow_unused=True)
    assert torch.equal(buckets.finish(), expected)
