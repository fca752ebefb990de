"""Blockwise quantization: each value within half its block's scale, the bytes it states, error
feedback that loses at most one sync's rounding over a run, and malformed buffers refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from psserver.common.messages import QuantizedFlat
from psserver.common.quantize import ErrorFeedback, check, dequantize, nbytes, quantize


def values(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n,block", [(1, 256), (7, 4), (255, 16), (256, 256), (1001, 256)])
def test_each_value_is_within_half_its_blocks_scale(bits, n, block):
    x = values(n)
    q = quantize(x, bits, block)
    back = dequantize(q, n)
    scale = q.scales[torch.arange(n) // block]
    assert ((x - back).abs() <= scale / 2 * (1 + 1e-6)).all()
    # The largest magnitude of each block is coded exactly at +-q_max.
    top = torch.tensor([x[i:i + block].abs().argmax() + i for i in range(0, n, block)])
    assert torch.allclose(back[top], x[top], rtol=1e-6, atol=0)
    assert nbytes(q) == (n if bits == 8 else (n + 1) // 2) + 4 * q.scales.numel()


def test_zeros_and_a_block_of_zeros_come_back_zero():
    x = torch.cat([torch.zeros(300), values(10)])
    for bits in (8, 4):
        back = dequantize(quantize(x, bits, 256))
        assert torch.equal(back[:256], torch.zeros(256))


def test_a_non_finite_value_or_nothing_has_no_code():
    for bad in (torch.tensor([1.0, float("inf")]), torch.tensor([float("nan")]), torch.zeros(0)):
        with pytest.raises(ValueError):
            quantize(bad, 8)


def test_error_feedback_loses_at_most_the_last_syncs_rounding():
    """Sum of what was sent = sum of the pseudo-gradients - the residual left: nothing is lost
    over a run but what the last sync rounded."""
    for bits in (8, 4):
        fb = ErrorFeedback(bits, block=32)
        xs = [values(100, seed=s) for s in range(20)]
        sent = sum(dequantize(fb.compress(x)) for x in xs)
        assert torch.allclose(sent, sum(xs) - fb.residual, atol=1e-4)
        scale = sum(xs).abs().max()  # the residual is one sync's rounding, far below the sum's size
        assert fb.residual.abs().max() < 0.1 * scale


def test_malformed_buffers_are_refused_before_they_are_read():
    q = quantize(values(100), 4, 32)
    for change, says in (
            ({"bits": 3}, "8 or 4 bits"), ({"bits": True}, "8 or 4 bits"), ({"numel": 0}, "numel"),
            ({"numel": 10**12}, "elements in blocks"), ({"block": 2**30}, "block is at most"),
            ({"data": q.data.to(torch.int32)}, "1-d torch.uint8"), ({"scales": q.scales[:-1]}, "scales, not"),
            ({"scales": torch.full_like(q.scales, float("nan"))}, "finite"),
            ({"scales": -q.scales}, ">= 0"), ({"data": "x"}, "uint8 tensor")):
        with pytest.raises(ValueError, match=says):
            dequantize(dataclasses.replace(q, **change))
    with pytest.raises(ValueError, match="where 99 are expected"):
        check(q, 99)
    with pytest.raises(ValueError, match="QuantizedFlat"):
        check(torch.zeros(3))
    assert isinstance(check(q, 100), QuantizedFlat)
