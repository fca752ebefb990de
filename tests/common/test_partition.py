"""The partition plan of several server processes : by size, deterministic, recorded."""

from __future__ import annotations

import pytest
import torch

from psserver.common.partition import SPLIT_ABOVE, PartitionPlan, Piece, make_plan
from psserver.models import build_model


def sizes_of(model: str) -> list[int]:
    return [p.numel() for p in build_model(model).parameters()]


@pytest.mark.parametrize("model", ["mnist_cnn", "mlp", "mlp_wide", "resnet18"])
@pytest.mark.parametrize("servers", [1, 2, 3, 4, 8])
def test_every_element_is_held_once_and_the_load_is_balanced(model, servers):
    sizes = sizes_of(model)
    plan = make_plan(sizes, servers)
    covered = [torch.zeros(n, dtype=torch.int32) for n in sizes]
    for p in plan.pieces:
        covered[p.param][p.start:p.stop] += 1
    assert all(bool((c == 1).all()) for c in covered)
    per = plan.elements_per_server()
    assert sum(per) == sum(sizes)
    assert max(per) <= 1.10 * sum(sizes) / servers  # each server about 1/S of the bytes (within 10 %)


def test_large_parameters_are_cut_across_every_server_and_small_ones_packed_whole():
    plan = make_plan([SPLIT_ABOVE + 1, 10, 7, 3], 2)
    big = [p for p in plan.pieces if p.param == 0]
    assert [(p.start, p.stop, p.server) for p in big] == [(0, SPLIT_ABOVE // 2 + 1, 0),
                                                          (SPLIT_ABOVE // 2 + 1, SPLIT_ABOVE + 1, 1)]
    assert all(p.start == 0 and p.stop == n for p, n in zip(plan.pieces[2:], [10, 7, 3], strict=True))
    assert make_plan([5, 5], 1).pieces == (Piece(0, 0, 5, 0), Piece(1, 0, 5, 0))
    assert make_plan([SPLIT_ABOVE * 2], 1).pieces == (Piece(0, 0, SPLIT_ABOVE * 2, 0),)


def test_split_and_gather_are_inverse_and_keep_the_models_order():
    model = build_model("mnist_cnn", seed=0)
    params = [p.detach() for p in model.parameters()]
    plan = make_plan([p.numel() for p in params], 3, split_above=1000)
    buffers = plan.split(params)
    assert [b.numel() for b in buffers] == plan.elements_per_server()
    back = plan.gather(buffers, params)
    assert all(torch.equal(a, b) and a.shape == b.shape for a, b in zip(back, params, strict=True))
    with pytest.raises(ValueError, match="buffers for 3 servers"):
        plan.gather(buffers[:2], params)
    with pytest.raises(ValueError, match="tensors of"):
        plan.split(params[:-1])


def test_a_plan_is_recorded_and_read_back_and_checked():
    sizes = sizes_of("mlp")
    plan = make_plan(sizes, 2, split_above=50_000)
    assert PartitionPlan.from_dict(plan.to_dict()) == plan
    assert make_plan(sizes, 2, split_above=50_000) == plan  # every process computes the same one
    plan.check_model(sizes)
    with pytest.raises(ValueError, match="the model has"):
        plan.check_model(sizes[:-1])
    forged = plan.to_dict()
    forged["pieces"][0][3] = 1 - forged["pieces"][0][3]
    with pytest.raises(ValueError, match="not the one"):
        PartitionPlan.from_dict(forged)
    with pytest.raises(ValueError, match="not a partition plan"):
        PartitionPlan.from_dict({"format": 1})
    with pytest.raises(ValueError, match="--num-servers"):
        make_plan(sizes, 0)
