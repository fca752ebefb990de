"""A model's layout: what a server without the model's code knows of it, as plain data."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from psserver.models import build_model
from psserver.models.layout import Entry, ModelLayout, values_of


def _one(shape, dtype="float32", key="w") -> dict:
    """A layout of one parameter, as plain data."""
    return {"format": 1, "entries": [[key, shape, dtype, "parameter", True]]}


class Tied(nn.Module):
    """Tied weights, a BatchNorm's buffers, a non-persistent buffer and a frozen parameter."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, width)
        self.norm = nn.BatchNorm1d(width)
        self.out = nn.Linear(width, 10)
        self.out.weight = self.emb.weight
        self.scale = nn.Parameter(torch.ones(1), requires_grad=False)
        self.register_buffer("cache", torch.zeros(3), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.emb(ids))) * self.scale


def test_parameters_in_training_order_then_persistent_buffers():
    model = Tied()
    layout = ModelLayout.of(model)
    assert [e.key for e in layout.parameters] == [n for n, _ in model.named_parameters()]
    assert [e.key for e in layout.buffers] == ["norm.running_mean", "norm.running_var", "norm.num_batches_tracked"]
    assert layout.aliases == (("out.weight", "emb.weight"),)
    # The module's own parameter (scale) first, then its children's, as parameters() gives them.
    assert [e.requires_grad for e in layout.parameters] == [False, True, True, True, True]
    assert layout.buffers[-1].dtype == "int64" and layout.buffers[0].shape == (4,)
    # Back to the model's own keys, tied weights included: loads strictly into the model's class.
    state = layout.state_dict(values_of(model, layout))
    assert set(state) == set(model.state_dict())
    Tied().load_state_dict(state, strict=True)


def test_plain_data_round_trip_and_fingerprint():
    layout = ModelLayout.of(build_model("resnet18"))
    d = layout.to_dict()
    assert ModelLayout.from_dict(d) == layout
    assert ModelLayout.from_dict(d).fingerprint() == layout.fingerprint()
    assert ModelLayout.of(build_model("resnet18", seed=5)).fingerprint() == layout.fingerprint()  # values are not in it
    assert ModelLayout.of(build_model("mnist_cnn")).fingerprint() != layout.fingerprint()


def test_a_difference_names_the_first_keys_that_differ():
    server = ModelLayout.of(Tied(4))
    assert server.difference(ModelLayout.of(Tied(4))) == ""
    wider = server.difference(ModelLayout.of(Tied(6)))
    assert wider.startswith("emb.weight is [10, 6] float32, the server's [10, 4] float32; norm.weight is [6]")
    assert "(and " in wider and "\n" not in wider
    other = server.difference(ModelLayout.of(nn.Linear(2, 2)))
    assert other.startswith("scale is missing; weight is not in the server's model; emb.weight is missing")


@pytest.mark.parametrize("bad", [None, [], {"format": 9, "entries": []}, {"format": 1},
                                 {"format": 1, "entries": [["w", [2, -1], "float32", "parameter", True]]},
                                 {"format": 1, "entries": [["w", [2], "nofloat", "parameter", True]]},
                                 {"format": 1, "entries": [["w", [2], "float32", "weights", True]]},
                                 {"format": 1, "entries": [["w", [2], "float32", "parameter", True]] * 2},
                                 {"format": 1, "entries": [[1, 2]]},
                                 _one([10**12, 10**12]), _one([2] * 65), _one([True]), _one([2.0]), _one(["2"]),
                                 _one(7), _one([2], dtype="Tensor"), _one([2], dtype=["float32"]),
                                 _one([2], dtype="int64"), _one([2], key=None),
                                 {"format": 1, "entries": {"w": 1}},
                                 {"format": 1, "entries": [["w", [2], "float32", "parameter", True]],
                                  "aliases": [["v", ["w"]]]},
                                 {"format": 1, "entries": [["w", [2], "float32", "parameter", True]],
                                  "aliases": [["v", "u"]]}],
                         ids=lambda v: repr(v)[:50])
def test_garbage_is_not_a_layout(bad):
    """Checked whole before anything is built from it: a shape of 10^12 x 10^12 was a torch
    RuntimeError (storage size overflowed), a bool dimension a TypeError, in the server."""
    with pytest.raises(ValueError, match="not a model layout"):
        ModelLayout.from_dict(bad)


def test_nbytes_is_the_sum_of_numel_times_element_size():
    layout = ModelLayout.of(Tied())
    assert layout.nbytes() == sum(t.numel() * t.element_size() for t in values_of(Tied(), layout))
    huge = ModelLayout.from_dict(_one([10**12]))  # no tensor is made for it
    assert huge.nbytes() == 4 * 10**12
    assert ModelLayout.from_dict(_one([0, 5])).nbytes() == 0
    with pytest.raises(ValueError, match="bad shape"):
        ModelLayout((Entry("w", (-1, 2), "float32", "parameter"),)).nbytes()
    with pytest.raises(ValueError, match="unknown dtype"):
        ModelLayout((Entry("w", (2,), "float99", "parameter"),)).nbytes()




def test_an_integer_parameter_is_refused():
    model = nn.Module()
    model.steps = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    with pytest.raises(ValueError, match=r"parameter steps is torch\.int64"):
        ModelLayout.of(model)


def test_a_complex_buffer_is_refused_not_halved():
    """Buffers travel as one float64 tensor: a complex one would come back without its
    imaginary part, on a server that built the model itself (``serve --model``) too."""
    model = nn.Linear(2, 2)
    model.register_buffer("phase", torch.tensor([1 + 2j]))
    with pytest.raises(ValueError, match=r"buffer phase is torch\.complex64"):
        ModelLayout.of(model)


def test_trained_parameters_of_two_dtypes_are_refused_one_dtype_of_any_kind_is_not():
    """A float64 layer beside float32 ones joined and then failed at every step, on the server
    ('attempting to assign a gradient with dtype double'); a forged layout saying so too."""
    mixed = nn.Sequential(nn.Linear(4, 3).double(), nn.Linear(3, 2))
    says = r"trained parameters are of 2 dtypes \(0\.weight is float64, 1\.weight is float32\)"
    with pytest.raises(ValueError, match=says):
        ModelLayout.of(mixed)
    forged = ModelLayout.of(nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))).to_dict()
    forged["entries"][0][2] = "float64"
    with pytest.raises(ValueError, match=r"trained parameters are of 2 dtypes"):
        ModelLayout.from_dict(forged)
    for dtype in (torch.float64, torch.bfloat16):
        assert {e.dtype for e in ModelLayout.of(nn.Linear(4, 3).to(dtype)).parameters} == {str(dtype)[6:]}
