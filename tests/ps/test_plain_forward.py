"""The RPC tutorial's server half: a forward outside a ``dist_autograd`` context (an
evaluation) opens no step, so the trainer's clock does not count it."""

from __future__ import annotations

import torch

from psserver.config import OptimizerConfig, ServerConfig
from psserver.ps.engine.engine import StepEngine
from psserver.ps.protocols.plain import PlainServer
from psserver.ps.rpc import torch_rpc


def clock(engine: StepEngine) -> int:
    progress = engine.trainer_progress("t")
    return 0 if progress is None else progress.clock


def test_a_forward_outside_an_autograd_context_is_no_step(monkeypatch):
    engine = StepEngine(ServerConfig(model="mlp", devices=["cpu"], optimizer=OptimizerConfig("sgd", 0.1)),
                        [torch.device("cpu")])
    try:
        half = PlainServer(engine)
        engine.trainer_joined("t")
        context: list[int | None] = [None]
        monkeypatch.setattr(torch_rpc, "current_autograd_context_id", lambda: context[0])
        x = torch.randn(4, 1, 28, 28)
        outs = [half.forward("t", x) for _ in range(3)]  # the tutorial's evaluation: no context
        assert clock(engine) == 0 and engine.wait_idle(0.0) == []
        assert all(out.shape == (4, 10) and not out.requires_grad for out in outs)  # no graph kept
        context[0] = 1  # the training loop's forward: a step opens, the clock ticks
        assert half.forward("t", x).requires_grad
        assert clock(engine) == 1 and engine.wait_idle(0.0) == ["t"]
    finally:
        engine.close()
