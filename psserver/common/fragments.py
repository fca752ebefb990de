"""The fragments of streaming DiLoCo: the model's parameters in F groups, each synced on its
own staggered schedule (Douillard et al., 2025, "Streaming DiLoCo with overlapping
communication", arXiv 2501.18512).

A fragment is a set of whole parameters: its pseudo-gradient and its global weights travel as
one flat buffer of them, in the model's order, and the server's optimizer steps them as it steps
any gradient that leaves the others out. The groups are a pure function of the parameter sizes
and F, so the trainer and the server compute the same ones without agreeing on them: largest
parameter first, each onto the fragment holding the fewest elements so far, which keeps every
fragment within one parameter of an equal share and spreads the layers of a deep model over all
of them (the paper's strided fragments do the same by depth).

With several server processes each fragment is cut again by the partition plan
(``psserver.common.partition``): server s's part of fragment f is group f of the pieces server
s holds, so every server steps whole pieces of its own, each fragment spans every server, and a
fragment's sync is one call to each of them at once.

No RPC here: the groups and the schedule, testable on their own.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from psserver.common.partition import PartitionPlan


def fragment_groups(sizes: Sequence[int], count: int) -> list[list[int]]:
    """The parameters (indices in the model's order, ascending) of each of ``count`` fragments
    (``ValueError``: fewer parameters than fragments, or a count below 1)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"a model is cut into an int >= 1 of fragments, got {count!r}")
    if count > len(sizes):
        raise ValueError(f"{count} fragments of a model of {len(sizes)} parameters: each fragment holds whole "
                         "parameters, so at most one per parameter")
    groups: list[list[int]] = [[] for _ in range(count)]
    heap = [(-1, f) for f in range(count)]  # (values held, -1 while empty: an empty fragment first; index)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        held, f = heapq.heappop(heap)
        groups[f].append(i)
        heapq.heappush(heap, (max(held, 0) + sizes[i], f))
    return [sorted(g) for g in groups]


def fragment_offsets(local_steps: int, count: int) -> list[int]:
    """The inner step within each window (0 <= offset < H) at which each fragment syncs: spread
    evenly, so that one fragment's exchange is on the wire at a time."""
    return [f * local_steps // count for f in range(count)]


def pack(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """A fragment's parameters (or anything shaped as them) as one flat fp32 buffer of its own."""
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def unpack_into(flat: torch.Tensor, params: Sequence[torch.Tensor], keep: float = 0.0) -> None:
    """``params <- keep * params + (1 - keep) * flat`` (``keep`` 0: a copy), ``flat`` holding
    them in order (``ValueError`` for one of another size)."""
    total = sum(p.numel() for p in params)
    if flat.numel() != total:
        raise ValueError(f"a fragment of {flat.numel()} values for parameters of {total}")
    offset = 0
    with torch.no_grad():
        for p in params:
            value = flat[offset:offset + p.numel()].view_as(p).to(p.device, p.dtype)
            if keep:
                p.mul_(keep).add_(value, alpha=1.0 - keep)
            else:
                p.copy_(value)
            offset += p.numel()


def server_pieces(params: Sequence[torch.Tensor], plan: PartitionPlan | None, server: int) -> list[torch.Tensor]:
    """What ``server`` holds of ``params``, as views that share their storage (writing into
    them writes into the parameters): the plan's pieces of it, in its order; without a plan
    (one server process) every parameter whole. ``ValueError`` for a parameter that is not
    contiguous, which a view of it could not write back into."""
    if plan is None:
        return [p.detach() for p in params]
    flat = []
    for i, p in enumerate(params):
        if not p.is_contiguous():
            raise ValueError(f"parameter {i} of shape {tuple(p.shape)} is not contiguous: its pieces on the "
                             "server processes cannot be views of it")
        flat.append(p.detach().view(-1))
    return [flat[piece.param][piece.start:piece.stop] for piece in plan.for_server(server)]
