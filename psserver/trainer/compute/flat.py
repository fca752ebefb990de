"""Many tensors as one contiguous buffer, and back, with one kernel each way.

A step's parameters and gradients cross between trainer and server as one flat buffer per
shard: TensorPipe pays per tensor (per CUDA tensor most of all: IPC handles and events), and
one buffer is one copy. Packing is ``torch.cat`` into a buffer allocated once (:class:`FlatBuffer`,
any dtype: the cast to the wire dtype happens in the same kernel), unpacking one
``torch._foreach_copy_`` from views of the buffer (:func:`copy_flat_into`): a step allocates
nothing and launches a few kernels however many parameters the model has.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class FlatBuffer:
    """One preallocated 1-D buffer for tensors of fixed sizes (``numels``), reused by every
    :meth:`pack`: what it returned before is overwritten, so a caller packs again only once the
    previous buffer is no longer needed (sent, and its call answered)."""

    def __init__(self, numels: Sequence[int], dtype: torch.dtype, device: torch.device | str) -> None:
        self.numels = list(numels)
        self.buffer = torch.empty(sum(self.numels), dtype=dtype, device=device)

    def pack(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``tensors`` (their sizes as given; any dtype, on the buffer's device) concatenated into the buffer."""
        if [t.numel() for t in tensors] != self.numels:
            raise ValueError(f"tensors of {[t.numel() for t in tensors]} values for a buffer of {self.numels}")
        if not tensors:
            return self.buffer
        with torch.no_grad():
            torch.cat([t.detach().reshape(-1) for t in tensors], out=self.buffer)
        return self.buffer


def copy_flat_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` (the values of ``tensors`` one after the other, any dtype and device) into
    ``tensors``, each keeping its dtype and device (all on one device)."""
    numels = [t.numel() for t in tensors]
    if flat.dim() != 1 or flat.numel() != sum(numels):
        raise ValueError(f"a flat buffer of shape {tuple(flat.shape)} for tensors of {sum(numels)} values")
    if not tensors:
        return
    flat = flat.to(tensors[0].device, non_blocking=True)
    views = [v.view_as(t) for v, t in zip(flat.split(numels), tensors, strict=True)]
    with torch.no_grad():
        torch._foreach_copy_(list(tensors), views)
