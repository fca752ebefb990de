"""Blockwise quantization of a flat fp32 buffer to int8 or 4 bits, and error feedback.

DiLoCo's pseudo-gradients tolerate coarse quantization where its error is fed back: what one
sync rounds away is added to the next one's pseudo-gradient, so over a run the server receives
the sum of the pseudo-gradients up to one sync's rounding (Streaming DiLoCo sends 4 bits).

Each block of ``block`` elements keeps its own scale, ``max|x| / q_max`` (``q_max`` 127 for
int8, 7 for 4 bits), and each element ``round(x / scale)``: one element is off by at most half
its block's scale. 4-bit codes are stored two per byte, offset by 8. Bytes on the wire for n
elements: n (int8) or n/2 (4 bits), plus 4 per block, against 4n in fp32.

Both sides import this module: the trainer quantizes, the server checks and dequantizes what
arrived (every field of a :class:`~psserver.common.messages.QuantizedFlat` a stranger could
have written is checked before it is read).
"""

from __future__ import annotations

import math

import torch

from psserver.common.messages import QuantizedFlat

Q_MAX = {8: 127, 4: 7}
BLOCK = 256
MAX_BLOCK = 1 << 20


def bits_of(compress: str) -> int | None:
    """The code width of a ``--compress`` choice (``psserver.config.trainer.COMPRESSIONS``; None:
    not quantized)."""
    return {"none": None, "int8": 8, "int4": 4}[compress]


def quantize(x: torch.Tensor, bits: int, block: int = BLOCK) -> QuantizedFlat:
    """``x`` (a flat floating tensor, finite) as ``bits``-bit codes with one fp32 scale per block."""
    if bits not in Q_MAX:
        raise ValueError(f"quantize: bits are 8 or 4, not {bits!r}")
    flat = x.detach().reshape(-1).to(torch.float32)
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("quantize: a non-finite value has no code")
    n = flat.numel()
    if n == 0 or not 1 <= block <= MAX_BLOCK:
        raise ValueError(f"quantize: {n} elements in blocks of {block}: nothing to code")
    blocks = math.ceil(n / block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=flat.device)
    padded[:n] = flat
    padded = padded.view(blocks, block)
    q_max = Q_MAX[bits]
    scales = padded.abs().amax(dim=1) / q_max
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = torch.round(padded / safe[:, None]).clamp_(-q_max, q_max).to(torch.int8).view(-1)[:n]
    if bits == 4:
        nibbles = (codes + 8).to(torch.uint8)
        if n % 2:
            nibbles = torch.cat([nibbles, torch.full((1,), 8, dtype=torch.uint8, device=nibbles.device)])
        data = nibbles[0::2] | (nibbles[1::2] << 4)
    else:
        data = codes.view(torch.uint8)
    return QuantizedFlat(data=data.cpu(), scales=scales.cpu(), bits=bits, numel=n, block=block)


def check(q: object, numel: int | None = None) -> QuantizedFlat:
    """``q`` if it is a well-formed :class:`QuantizedFlat` (of ``numel`` elements, when given);
    ``ValueError`` naming what is wrong otherwise."""
    if not isinstance(q, QuantizedFlat):
        raise ValueError(f"a quantized buffer is a QuantizedFlat, not {type(q).__name__}")
    if isinstance(q.bits, bool) or q.bits not in Q_MAX:
        raise ValueError(f"a quantized buffer has 8 or 4 bits, not {q.bits!r}")
    for name in ("numel", "block"):
        v = getattr(q, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"a quantized buffer's {name} is an int >= 1, not {v!r}")
    if q.block > MAX_BLOCK:
        raise ValueError(f"a quantized buffer's block is at most {MAX_BLOCK}, not {q.block}")
    if numel is not None and q.numel != numel:
        raise ValueError(f"a quantized buffer of {q.numel} elements where {numel} are expected")
    for name, dtype in (("data", torch.uint8), ("scales", torch.float32)):
        t = getattr(q, name)
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1 or t.is_sparse:
            raise ValueError(f"a quantized buffer's {name} is a 1-d {dtype} tensor")
    want_data = q.numel if q.bits == 8 else math.ceil(q.numel / 2)
    want_scales = math.ceil(q.numel / q.block)
    if q.data.numel() != want_data or q.scales.numel() != want_scales:
        raise ValueError(f"a quantized buffer of {q.numel} elements in blocks of {q.block} has {want_data} bytes "
                         f"and {want_scales} scales, not {q.data.numel()} and {q.scales.numel()}")
    if not bool((torch.isfinite(q.scales) & (q.scales >= 0)).all()):
        raise ValueError("a quantized buffer's scales are finite and >= 0")
    return q


def dequantize(q: QuantizedFlat, numel: int | None = None) -> torch.Tensor:
    """The fp32 values ``q`` stands for (checked first: :func:`check`)."""
    check(q, numel)
    data = q.data.contiguous()
    if q.bits == 4:
        codes = torch.stack([data & 0x0F, data >> 4], dim=1).reshape(-1)[:q.numel].to(torch.int16) - 8
    else:
        codes = data.view(torch.int8)
    blocks = q.scales.numel()
    padded = torch.zeros(blocks * q.block, dtype=torch.float32)
    padded[:q.numel] = codes
    return (padded.view(blocks, q.block) * q.scales[:, None]).view(-1)[:q.numel]


def nbytes(q: QuantizedFlat) -> int:
    """What ``q`` puts on the wire: its codes and its scales."""
    return q.data.numel() + 4 * q.scales.numel()


class ErrorFeedback:
    """The rounding of each sync carried into the next: ``y = x + e``, send ``Q(y)``, keep
    ``e = y - deQ(Q(y))``. One per buffer sent (one residual each); a trainer that rejoins
    starts with none."""

    def __init__(self, bits: int, block: int = BLOCK) -> None:
        self.bits, self.block = bits, block
        self.residual: torch.Tensor | None = None

    def compress(self, x: torch.Tensor) -> QuantizedFlat:
        y = x.detach().reshape(-1).to(torch.float32)
        if self.residual is not None and self.residual.numel() == y.numel():
            y = y + self.residual.to(y.device)
        q = quantize(y, self.bits, self.block)
        self.residual = (y.cpu() - dequantize(q)).to(y.device)
        return q
