"""The calling convention of a batch's input: ``model(x)``, ``model(*x)``, ``model(**x)``."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from psserver.models.calling import call_model, describe_input, input_batch_size, model_arguments, move_input


class Towers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(2, 3), nn.Linear(4, 3)

    def forward(self, left, right=None):
        return self.left(left) + (0 if right is None else self.right(right))


def test_tensor_tuple_and_dict_inputs():
    model = Towers()
    a, b = torch.randn(5, 2), torch.randn(5, 4)
    assert torch.equal(call_model(model, a), model(a))
    assert torch.equal(call_model(model, (a, b)), model(a, b))
    assert torch.equal(call_model(model, [a, b]), model(a, b))  # the collation's list of a tuple
    assert torch.equal(call_model(model, {"left": a, "right": b}), model(left=a, right=b))
    # The same split feeds torch.func.functional_call (--step pull).
    args, kwargs = model_arguments({"left": a, "right": b})
    assert torch.equal(functional_call(model, dict(model.named_parameters()), args, kwargs), model(a, b))


def test_moving_counting_and_describing_inputs():
    a, b = torch.randn(5, 2), torch.zeros(5, 4, dtype=torch.long)
    moved = move_input({"x": a, "y": (b, "tag")}, "cpu")
    assert torch.equal(moved["x"], a) and moved["y"][1] == "tag"
    assert [input_batch_size(x) for x in (a, (a, b), {"k": b}, ((a,), b))] == [5, 5, 5, 5]
    with pytest.raises(ValueError, match="holds no tensor"):
        input_batch_size(("a", "b"))
    assert describe_input(torch.zeros(64, 1, 28, 28)) == "(1, 28, 28)"
    assert describe_input((a, b)) == "((2,), (4,))"
    assert describe_input({"ids": b}) == "{ids: (4,)}"
    assert describe_input(torch.zeros(64)) == "()"
