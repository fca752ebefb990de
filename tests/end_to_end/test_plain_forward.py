"""The RPC tutorial's server half: a forward the trainer marks as an evaluation (it ran under
``no_grad`` or outside a ``dist_autograd`` context) opens no step, so its clock does not count it."""

from __future__ import annotations

import torch

from psserver.config import OptimizerConfig, ServerConfig
from psserver.server.engine.engine import StepEngine
from psserver.server.steps.plain import PlainServer


def clock(engine: StepEngine) -> int:
    progress = engine.trainer_progress("t")
    return 0 if progress is None else progress.clock


def test_an_evaluation_forward_is_no_step():
    engine = StepEngine(ServerConfig(model="mlp", devices=["cpu"], optimizer=OptimizerConfig("sgd", 0.1)),
                        [torch.device("cpu")])
    try:
        half = PlainServer(engine)
        engine.trainer_joined("t")
        x = torch.randn(4, 1, 28, 28)
        outs = [half.forward("t", x, False) for _ in range(3)]  # the tutorial's evaluation
        assert clock(engine) == 0 and engine.wait_idle(0.0) == []
        assert all(out.shape == (4, 10) and not out.requires_grad for out in outs)  # no graph kept
        assert half.forward("t", x).requires_grad  # the training loop's forward: a step opens, the clock ticks
        assert clock(engine) == 1 and engine.wait_idle(0.0) == ["t"]
    finally:
        engine.close()
