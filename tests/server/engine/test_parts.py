"""A gradient assembled from the parts a trainer sent while its backward ran."""

from __future__ import annotations

import pytest
import torch

from psserver.server.engine.gradient_parts import GradientParts

CPU = torch.device("cpu")


def test_parts_that_tile_every_shard_give_the_whole_gradient_in_reused_buffers():
    parts = GradientParts([6, 0, 4], torch.float32, [CPU] * 3)
    g = [torch.arange(6.0), torch.zeros(0), torch.arange(4.0) + 10]
    parts.put(1, [(0, 3, g[0][3:]), (2, 0, g[2])])  # ahead, as backward filled them
    parts.put(1, [(0, 0, g[0][:3])])  # the rest, with the step's call
    got = parts.take(1)
    assert all(torch.equal(a, b) for a, b in zip(got, g, strict=True))
    ptrs = [t.data_ptr() for t in got]
    parts.put(2, [(0, 0, g[0] * 2), (2, 0, g[2] * 2)])
    again = parts.take(2)
    assert [t.data_ptr() for t in again] == ptrs  # allocated once
    assert torch.equal(again[0], g[0] * 2)


def test_the_wire_dtype_is_kept_and_the_values_cast_into_it():
    parts = GradientParts([3], torch.bfloat16, [CPU])
    parts.put(1, [(0, 0, torch.tensor([1.0, 2.0, 3.0]))])
    (got,) = parts.take(1)
    assert got.dtype == torch.bfloat16 and got.tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("pieces", [
    [(0, 0, torch.ones(3))],  # a gap
    [(0, 0, torch.ones(4)), (0, 3, torch.ones(3))],  # an overlap
    [(0, 0, torch.ones(3)), (0, 3, torch.ones(3)), (0, 3, torch.ones(3))],  # one twice
])
def test_parts_that_do_not_cover_a_shard_once_are_refused(pieces):
    parts = GradientParts([6], torch.float32, [CPU])
    parts.put(1, pieces)
    with pytest.raises(ValueError, match="do not cover shard 0 once"):
        parts.take(1)


def test_a_step_sent_again_after_a_refused_call_starts_afresh():
    parts = GradientParts([4], torch.float32, [CPU])
    parts.put(1, [(0, 0, torch.ones(2))])
    with pytest.raises(ValueError, match="do not cover"):
        parts.take(1)
    parts.put(1, [(0, 0, torch.ones(2)), (0, 2, torch.ones(2))])  # all its parts again
    assert parts.take(1)[0].tolist() == [1.0] * 4


def test_a_new_step_overwrites_the_parts_of_one_that_never_got_its_call():
    parts = GradientParts([4], torch.float32, [CPU])
    parts.put(1, [(0, 0, torch.ones(2))])  # step 1 failed after this part
    parts.put(2, [(0, 2, torch.full((2,), 2.0))])
    with pytest.raises(ValueError, match="do not cover"):
        parts.take(2)  # step 1's part does not count for step 2
    parts.put(3, [(0, 0, torch.full((4,), 3.0))])
    with pytest.raises(ValueError, match="no parts of step 2"):
        parts.take(2)
    assert parts.take(3)[0].tolist() == [3.0] * 4
    with pytest.raises(ValueError, match="no parts of step 3"):
        parts.take(3)  # taken once


@pytest.mark.parametrize("part, message", [
    ((1, 0, torch.ones(2)), "of shard 1; the model has 1"),
    ((0, 3, torch.ones(2)), "outside shard 0's 4 values"),
    ((0, -1, torch.ones(2)), "outside"),
    ((0, 0, torch.ones(2, 2)), "1-D floating"),
    ((0, 0, torch.ones(2, dtype=torch.int64)), "1-D floating"),
    ((0, 0, [1.0, 2.0]), "1-D floating"),
    ((0, 0), "(shard, start, values)"),
    (("0", 0, torch.ones(2)), "of shard '0'"),
    ((True, 0, torch.ones(2)), "of shard True"),
    ((0, False, torch.ones(2)), "outside"),
    ((0, 0, torch.ones(2, device="meta")), "1-D floating"),
])
def test_a_part_that_does_not_fit_is_refused_and_nothing_of_its_call_is_kept(part, message):
    parts = GradientParts([4], torch.float32, [CPU])
    with pytest.raises(ValueError, match=message):
        parts.put(1, [(0, 0, torch.ones(2)), part])
    parts.put(1, [(0, 2, torch.ones(2))])
    with pytest.raises(ValueError, match="do not cover"):
        parts.take(1)  # the refused call's first part was not kept either
