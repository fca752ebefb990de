"""Deterministic 64-bit mixing on int64 tensors: spreads ids (sequential ones too) over a hash
table's slots, and gives every id its own reproducible pseudo-random values (an embedding
row's initial values, a synthetic data set's hidden structure), on any process, in any order."""

from __future__ import annotations

import math

import torch

_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64
_M1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M2 = -7723592293110705685  # 0x94D049BB133111EB


def mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (wrapping arithmetic): well-spread bits from any ids,
    sequential ones included. Also the source of the rows' deterministic initial values."""
    x = x + _GOLDEN
    x = (x ^ _shr(x, 30)) * _M1
    x = (x ^ _shr(x, 27)) * _M2
    return x ^ _shr(x, 31)


def _shr(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def normal_by_id(ids: torch.Tensor, dim: int, salt: int = 0) -> torch.Tensor:
    """``[n, dim]`` standard normal values, each row a pure function of (``salt``, id)."""
    cols = torch.arange(dim, dtype=torch.int64)
    base = mix64(ids.to(torch.int64) ^ (salt * 0x2545F491))
    bits = mix64(base.unsqueeze(1) * (dim + 1) + cols)
    # Box-Muller on the two 32-bit halves of one hash (u1 in (0, 1], u2 in [0, 1)).
    u1 = (_shr(bits, 32) + 1).to(torch.float64) / float(1 << 32)
    u2 = (bits & 0xFFFFFFFF).to(torch.float64) / float(1 << 32)
    return (torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)).to(torch.float32)
