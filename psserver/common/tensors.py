"""Flat tensors as both sides compute them: a model's persistent buffers in one flat tensor and
back, a slice of a shard's flat gradient (:data:`Part`), and the norm of a gradient, which the
trainer computes on what it sends and the server on what it applies, alike.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch
from torch import nn


def persistent_buffers(module: nn.Module) -> list[torch.Tensor]:
    """``module``'s buffers that its ``state_dict`` holds, in ``named_buffers()`` order, each once."""
    seen: set[int] = set()
    out = []
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is None or name in m._non_persistent_buffers_set or id(b) in seen:
                continue
            seen.add(id(b))
            out.append(b)
    return out


def flatten(buffers: Sequence[torch.Tensor]) -> torch.Tensor:
    """One float64 CPU tensor of ``buffers``' values."""
    if not buffers:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([b.detach().reshape(-1).to("cpu", torch.float64) for b in buffers])


def unflatten_into(flat: torch.Tensor, buffers: Sequence[torch.Tensor]) -> None:
    """Copy ``flat`` (from :func:`flatten`) into ``buffers``, each in its own dtype and device
    (integers rounded)."""
    offset = 0
    with torch.no_grad():
        for b in buffers:
            part = flat[offset:offset + b.numel()].view(b.shape)
            if not b.is_floating_point():
                part = part.round()
            b.copy_(part.to(b.device, b.dtype))
            offset += b.numel()




Part = tuple[int, int, torch.Tensor]
"""(shard, first element, values): one slice of a shard's flat gradient."""


def total_norm(grads: list[torch.Tensor]) -> float:
    """The L2 norm of all ``grads`` together, in fp32, whatever their devices (one host sync
    per device)."""
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_device[g.device].append(g)
    norms = []
    for device_grads in by_device.values():
        per = torch._foreach_norm([g.float() if g.dtype != torch.float32 else g for g in device_grads])
        norms.append(torch.linalg.vector_norm(torch.stack(per)).to("cpu"))
    if not norms:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(norms)))
