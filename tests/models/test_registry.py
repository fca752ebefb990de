import pytest
import torch

from psserver.models import build_model, check_model_name, get_model_spec, split_stages


@pytest.mark.parametrize("name", ["mnist_cnn", "mlp", "resnet18"])
def test_models_build_and_run(name):
    spec = get_model_spec(name)
    model = build_model(name)
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
