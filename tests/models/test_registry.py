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
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))


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
