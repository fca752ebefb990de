"""Streaming DiLoCo's fragments: every parameter in exactly one, the shares even within a
parameter, the places in the window spread."""

from __future__ import annotations

import pytest
import torch

from psserver.common.fragments import fragment_groups, fragment_offsets, pack, server_pieces, unpack_into
from psserver.common.partition import make_plan


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_every_parameter_is_in_one_fragment_and_the_shares_differ_by_at_most_one_parameter(count):
    sizes = [640, 10, 4096, 64, 4096, 64, 1000, 10, 7]
    groups = fragment_groups(sizes, count)
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    assert all(g == sorted(g) and g for g in groups)
    held = [sum(sizes[i] for i in g) for g in groups]
    assert max(held) - min(held) <= max(sizes)
    assert groups == fragment_groups(sizes, count)  # a pure function: both halves make the same


def test_more_fragments_than_parameters_is_refused():
    with pytest.raises(ValueError, match="3 fragments of a model of 2 parameters"):
        fragment_groups([4, 4], 3)


def test_the_places_in_the_window_are_spread_evenly():
    assert fragment_offsets(100, 4) == [0, 25, 50, 75]
    assert fragment_offsets(5, 2) == [0, 2]


def test_unpack_mixes_the_values_into_the_parameters_in_order():
    params = [torch.ones(2, 2), torch.zeros(3)]
    unpack_into(torch.arange(7.0), params, keep=0.5)
    assert torch.equal(params[0], torch.tensor([[0.5, 1.0], [1.5, 2.0]]))
    assert torch.equal(params[1], torch.tensor([2.0, 2.5, 3.0]))
    unpack_into(torch.arange(7.0), params)
    assert torch.equal(pack(params), torch.arange(7.0))
    with pytest.raises(ValueError, match="6 values for parameters of 7"):
        unpack_into(torch.zeros(6), params)


def test_a_servers_pieces_are_views_that_write_into_the_parameters():
    params = [torch.zeros(3, 4), torch.zeros(5)]
    plan = make_plan([12, 5], 2, split_above=4)
    for server in (0, 1):
        pieces = server_pieces(params, plan, server)
        assert [t.numel() for t in pieces] == [p.numel for p in plan.for_server(server)]
        unpack_into(torch.full((sum(t.numel() for t in pieces),), float(server + 1)), pieces)
    fills = [torch.full((n,), float(s + 1)) for s, n in enumerate(plan.elements_per_server())]
    assert all(torch.equal(p, want) for p, want in zip(params, plan.gather(fills, params), strict=True))
    assert server_pieces(params, None, 0)[1].data_ptr() == params[1].data_ptr()
    with pytest.raises(ValueError, match="not contiguous"):
        server_pieces([torch.zeros(4, 3).t()], make_plan([12], 2, split_above=4), 0)
