"""``ps.forward`` (the RPC tutorial's path) counts a training step only for a forward whose
backward can reach the server: an evaluation's forwards are not steps, nor samples."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import psserver
from psserver.common import torch_rpc


class PlainSession:
    """A joined ``step='plain'`` session whose remote forward is a local model (no server)."""

    step_protocol = "plain"
    report = None
    name = "trainer_0_1"

    def __init__(self) -> None:
        self.model = nn.Linear(8, 3)
        self.info = {"update": "async", "param_rrefs": []}
        self.progress = (0, 0.01, 0)
        self.lock = threading.Lock()
        self.marked: list[bool] = []
        """What each forward told the server: a training step, or an evaluation."""

    def call(self, op: str, x: torch.Tensor, training: bool) -> torch.Tensor:
        assert op == "forward"
        self.marked.append(training)
        return self.model(x)

    def leave(self) -> None:
        pass


@pytest.fixture
def plain(monkeypatch):
    ps = psserver.connect("127.0.0.1:1", handle_signals=False)
    ps.session = PlainSession()
    context: list[int | None] = [None]  # the dist_autograd context the caller is in
    monkeypatch.setattr(torch_rpc, "current_autograd_context_id", lambda: context[0])
    yield ps, context
    ps.close()


def test_only_a_forward_that_can_train_is_a_step(plain):
    ps, context = plain
    context[0] = 7
    ps.forward(torch.randn(32, 8))  # the training loop: inside dist_autograd.context(), grad on
    assert (ps.steps, ps.samples) == (1, 32) and ps.session.report.steps == 1
    with torch.no_grad():  # a validation pass inside the context
        ps.forward(torch.randn(32, 8))
    context[0] = None
    for _ in range(3):  # the tutorial's get_accuracy: no context (and no_grad or not)
        ps.forward(torch.randn(16, 8))
    assert (ps.steps, ps.samples) == (1, 32)
    assert (ps.session.report.steps, ps.session.report.samples) == (1, 32)
    assert ps.position.epoch_samples == 32  # what a rejoined sampler skips
    assert ps.session.marked == [True, False, False, False, False]  # the server opens a step for the first only
