"""A shard's state as a checkpoint brings it: tensors of another dtype are refused (torch would
cast them silently), its own state loads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psserver.config import OptimizerConfig
from psserver.server.engine.shard import Shard

ADAM = OptimizerConfig(name="adam", lr=0.01)


def trained_shard() -> Shard:
    shard = Shard(0, nn.Sequential(nn.Linear(4, 3)), torch.device("cpu"))
    shard.init_optimizer(ADAM)
    for p in shard.params:
        p.grad = torch.ones_like(p)
    shard.optimizer.step()
    return shard


def test_a_weight_or_a_moment_of_another_dtype_is_refused_and_the_own_state_loads():
    state = trained_shard().state_dict()
    fresh = Shard(0, nn.Sequential(nn.Linear(4, 3)), torch.device("cpu"))
    half = {**state, "module": {**state["module"], "0.weight": state["module"]["0.weight"].half()}}
    with pytest.raises(ValueError, match=r"^its 0.weight is float16, the model's is float32$"):
        fresh.load_state_dict(half, ADAM)
    moments = {**state["optimizer"]["state"], 1: {**state["optimizer"]["state"][1]}}
    moments[1]["exp_avg"] = moments[1]["exp_avg"].double()
    wide = {**state, "optimizer": {**state["optimizer"], "state": moments}}
    with pytest.raises(ValueError, match=r"^its optimizer state 1.exp_avg is float64, its parameter's is float32$"):
        fresh.load_state_dict(wide, ADAM)
    fresh.load_state_dict(state, ADAM)
    assert torch.equal(fresh.module[0].weight, state["module"]["0.weight"])
