"""A server without ``--model``: it holds the tensors of the model the first trainer brings."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psserver.config import OptimizerConfig, ServerConfig
from psserver.models import build_model
from psserver.models.layout import ModelLayout, values_of
from psserver.server.engine.engine import StepEngine
from psserver.server.engine.held_model import HeldModel, check_values
from tests.models.test_layout import Tied


def test_held_tensors_are_the_models_under_its_own_keys():
    model = Tied()
    model.norm.running_mean.fill_(0.5)
    layout = ModelLayout.of(model)
    held = HeldModel(layout, values_of(model, layout))
    assert [p.shape for p in held.parameters()] == [p.shape for p in model.parameters()]
    assert [p.requires_grad for p in held.parameters()] == [p.requires_grad for p in model.parameters()]
    state = held.state_dict()
    assert set(state) == set(model.state_dict()) and torch.equal(state["norm.running_mean"], torch.full((4,), 0.5))
    again = HeldModel(layout)
    again.load_state_dict(model.state_dict(), strict=True)
    assert all(torch.equal(a, b) for a, b in zip(again.tensors(), held.tensors(), strict=True))
    with pytest.raises(RuntimeError, match="Unexpected key"):
        again.load_state_dict({**model.state_dict(), "extra": torch.zeros(1)}, strict=True)
    with pytest.raises(RuntimeError, match="holds the model's tensors, not its code"):
        held(torch.zeros(1))


def test_values_are_checked():
    layout = ModelLayout.of(Tied())
    good = values_of(Tied(), layout)
    for values, match in [(good[:-1], "for a model of"), ("x", "str initial values"),
                          ([torch.zeros(3), *good[1:]], r"scale is \[3\] torch.float32, its layout says \[1\] float32"),
                          ([good[0].double(), *good[1:]], "float64"),
                          ([good[0], torch.full_like(good[1], float("nan")), *good[2:]], "emb.weight is not finite")]:
        with pytest.raises(ValueError, match=match):
            check_values(layout, values)


def test_an_engine_without_model_adopts_the_first_and_checks_the_rest():
    engine = StepEngine(ServerConfig(devices=["cpu"], optimizer=OptimizerConfig()), [torch.device("cpu")])
    try:
        assert not engine.has_model and engine.shards == [] and engine.num_params == 0
        model = build_model("mlp", seed=3)
        layout = ModelLayout.of(model)
        engine.adopt(layout, values_of(model, layout), "mlp", {})
        assert engine.has_model and engine.model_ref == "mlp" and engine.shards[0].optimizer is not None
        assert torch.equal(engine.flat_parameters()[0], torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
        engine.check_layout(ModelLayout.of(build_model("mlp")), "trainer 1")
        with pytest.raises(ValueError, match=r"trainer 1 differs from the server's \(mlp\): 1.weight is missing"):
            engine.check_layout(ModelLayout.of(build_model("mnist_cnn")), "trainer 1")
        with pytest.raises(RuntimeError, match="holds a model already"):
            engine.adopt(layout, None, "mlp", {})
    finally:
        engine.close()


class Masked(nn.Module):
    """The smallest model with a causal mask of ``-inf`` in a (persistent) buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(3))


def test_a_buffer_may_be_minus_inf_but_a_parameter_may_not():
    model = Masked()
    layout = ModelLayout.of(model)
    check_values(layout, values_of(model, layout))
    with torch.no_grad():
        model.fc.bias[0] = float("-inf")
    with pytest.raises(ValueError, match=r"initial value of fc\.bias is not finite"):
        check_values(layout, values_of(model, layout))


def test_a_buffer_of_nan_or_complex_values_is_refused():
    """NaN made the server's own checkpoint unloadable; a complex buffer lost its imaginary part."""
    model = Masked()
    layout = ModelLayout.of(model)
    values = values_of(model, layout)
    values[-1] = torch.full_like(values[-1], float("nan"))
    with pytest.raises(ValueError, match="initial value of mask holds NaN"):
        check_values(layout, values)
    # A peer's layout may say complex (ModelLayout.of refuses to make one): its values are refused.
    model.register_buffer("phase", torch.ones(2))
    plain = ModelLayout.of(model).to_dict()
    plain["entries"] = [[*e[:2], "complex64", *e[3:]] if e[0] == "phase" else e for e in plain["entries"]]
    layout = ModelLayout.from_dict(plain)
    values = values_of(model, ModelLayout.of(model))
    values[-1] = values[-1].to(torch.complex64)
    with pytest.raises(ValueError, match="initial value of phase is complex"):
        check_values(layout, values)
