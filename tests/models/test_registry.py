import sys

import pytest
import torch

from psserver.errors import UserCodeError
from psserver.models import (
    ENTRY_POINT_GROUP,
    build_model,
    check_model_name,
    get_model_spec,
    model_names,
    resolve_model,
    split_stages,
)


@pytest.mark.parametrize(("name", "params"), [("mnist_cnn", 1_199_882), ("mlp", 235_146), ("resnet18", 11_173_962),
                                              ("resnet50", 23_520_842)])
def test_models_build_and_run(name, params):
    spec = get_model_spec(name)
    model = build_model(name)
    assert sum(p.numel() for p in model.parameters()) == params
    out = model(torch.randn(2, *spec.input_shape))
    assert out.shape == (2, spec.num_classes)


def test_build_is_deterministic():
    a, b = build_model("mlp", seed=3), build_model("mlp", seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_unknown_model_lists_known():
    with pytest.raises(ValueError, match=r"unknown model 'nope'; known: .*mlp.*mnist_cnn.*resnet18"):
        check_model_name("nope")


@pytest.mark.parametrize("n", [1, 2, 3])
def test_stages_compose_to_the_same_function(n):
    torch.manual_seed(0)
    model = build_model("mnist_cnn").eval()
    x = torch.randn(4, 1, 28, 28)
    stages = split_stages(model, n)
    assert len(stages) == n and all(len(s) > 0 for s in stages)
    out = x
    for s in stages:
        out = s(out)
    assert torch.allclose(out, model(x))
    assert sum(p.numel() for s in stages for p in s.parameters()) == sum(p.numel() for p in model.parameters())


def test_stages_balance_parameters():
    sizes = [sum(p.numel() for p in s.parameters()) for s in split_stages(build_model("resnet18"), 2)]
    # The split minimises the largest stage: no single block boundary does better.
    assert max(sizes) < 0.8 * sum(sizes)


def test_too_many_stages():
    with pytest.raises(ValueError, match="cannot split"):
        split_stages(build_model("mlp"), 50)


def test_tensor_parallel_plan_is_part_of_the_spec():
    spec = get_model_spec("llama_tiny")
    assert spec.tp_plan is not None and spec.tp_max_degree == 8
    block_cls, layout = spec.tp_plan
    model = build_model("llama_tiny")
    blocks = [m for m in model.modules() if type(m).__name__ == block_cls]
    assert blocks
    for block in blocks:
        names = dict(block.named_modules())
        assert all(isinstance(names.get(name), torch.nn.Linear) for name in layout), layout
    assert set(layout.values()) == {"colwise", "rowwise"}
    for name in ("mnist_cnn", "mlp", "resnet18"):
        assert get_model_spec(name).tp_plan is None and get_model_spec(name).tp_max_degree is None
    hash(spec)  # a frozen spec stays hashable with its plan


USER_MODELS = '''
import torch
from torch import nn


class TwoTower(nn.Module):
    """Not a Sequential: two inputs, a dict of them, a keyword argument."""

    def __init__(self, width=8):
        super().__init__()
        self.a = nn.Linear(4, width)
        self.b = nn.Linear(4, width)
        self.bn = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, 3)

    def forward(self, left, right):
        return self.head(self.bn(self.a(left) + self.b(right)))


def make_tower(width=8):
    return TwoTower(width=width)


def not_a_model():
    return 42


def on_meta():
    with torch.device("meta"):
        return nn.Sequential(nn.Linear(4, 3))


def no_parameters():
    return nn.Sequential(nn.ReLU())


def one_layer():
    return nn.Linear(4, 3)


INSTANCE = TwoTower()
'''


@pytest.fixture
def user_models(tmp_path, monkeypatch):
    (tmp_path / "mymodels.py").write_text(USER_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "mymodels"
    sys.modules.pop("mymodels", None)


@pytest.mark.parametrize("attr", ["TwoTower", "make_tower"])
def test_a_user_model_by_reference(user_models, attr):
    spec = resolve_model(f"mymodels:{attr}", {"width": 5})
    assert spec.name == f"mymodels:{attr}" and spec.input_shape is None and spec.args == {"width": 5}
    model = build_model(spec, seed=1)
    assert type(model).__name__ == "TwoTower" and model.a.out_features == 5
    again = build_model(spec, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(model.state_dict().values(), again.state_dict().values(),
                                                 strict=True))
    assert model(torch.randn(2, 4), torch.randn(2, 4)).shape == (2, 3)
    assert split_stages(model, 1) == [model]
    with pytest.raises(ValueError, match=r"a TwoTower is not an nn.Sequential of blocks: it runs as one stage"):
        split_stages(model, 2)


@pytest.mark.parametrize(("reference", "args", "match"), [
    ("mymodels:TwoTower", {"depth": 3}, r"--model mymodels:TwoTower does not accept these arguments: got an "
                                        r"unexpected keyword argument 'depth'"),
    ("mymodels:INSTANCE", {}, r"--model mymodels:INSTANCE is a TwoTower, not an nn.Module class or a function"),
    ("mymodels:Nope", {}, r"'mymodels' has no attribute 'Nope'"),
    ("theirmodels:Net", {}, r"module 'theirmodels' is not importable"),
])
def test_bad_model_references(user_models, reference, args, match):
    with pytest.raises(UserCodeError, match=match):
        resolve_model(reference, args)


def test_a_function_that_returns_no_module(user_models):
    with pytest.raises(UserCodeError, match=r"--model mymodels:not_a_model returned a int, not an nn.Module"):
        build_model(resolve_model("mymodels:not_a_model"))


@pytest.mark.parametrize(("attr", "match"), [
    ("on_meta", r"^--model mymodels:on_meta returned a model on the meta device \('0.weight' has no values\): "
                r"build it on the CPU$"),
    ("no_parameters", r"^--model mymodels:no_parameters returned a Sequential with no parameters: nothing to train$"),
])
def test_a_model_with_nothing_to_train_is_one_line(user_models, attr, match):
    with pytest.raises(UserCodeError, match=match):
        build_model(resolve_model(f"mymodels:{attr}"))


def test_a_model_of_one_layer_is_one_stage(user_models):
    model = build_model(resolve_model("mymodels:one_layer"))
    assert split_stages(model, 1) == [model]


def test_built_in_models_are_entry_points_of_the_group():
    from importlib.metadata import entry_points

    group = {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}
    assert set(model_names()) >= {"mnist_cnn", "mlp", "mlp_wide", "resnet18", "resnet50", "mf", "dlrm_tiny",
                                  "llama_tiny"}
    assert set(model_names()) <= set(group)
    for name in model_names():
        assert resolve_model(name).name == name
    # The same object by its reference as by its name.
    assert resolve_model(group["mnist_cnn"]) is resolve_model("mnist_cnn")
