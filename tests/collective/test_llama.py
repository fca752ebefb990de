"""``llama_tiny``: registry contract (Sequential of tensor-to-tensor blocks, long input)."""

from __future__ import annotations

import torch

from psserver.models import build_model, get_model_spec, split_stages


def test_llama_tiny_fits_the_registry():
    spec = get_model_spec("llama_tiny")
    assert spec.input_dtype == torch.long and spec.input_shape == (32,)
    model = build_model("llama_tiny", seed=0)
    assert isinstance(model, torch.nn.Sequential)
    x = torch.randint(0, 256, (4, *spec.input_shape))
    out = model(x)
    assert out.shape == (4, spec.num_classes)
    # The parameter server splits models into consecutive stages: they must chain.
    stages = split_stages(model, 3)
    y = x
    for stage in stages:
        y = stage(y)
    torch.testing.assert_close(y, out)
    # Deterministic initial parameters.
    other = build_model("llama_tiny", seed=0)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters(), strict=True))


def test_llama_tiny_is_causal():
    model = build_model("llama_tiny", seed=1)
    block = model[1]
    h = torch.randn(1, 8, 64)
    h2 = h.clone()
    h2[:, -1] += 1.0  # change the last position only
    torch.testing.assert_close(block(h)[:, :-1], block(h2)[:, :-1])
