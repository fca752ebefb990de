"""How the model's parameters are spread over several server processes.

By size, as the parameter servers that run at scale do (MXNet's KVStore splits arrays above a
bound across all servers; BytePS cuts tensors into 4 MB partitions; ps-lite gives each server
a key range): a parameter larger than ``split_above`` elements, or than 1/``SHARE_FRACTION``
of a server's share, is cut into one contiguous slice per server, so the largest tensors
never pile onto one process; the smaller ones are
packed whole, largest first, each onto the server holding the fewest elements so far. The
plan is a pure function of the parameter sizes and the number of servers, so every process
computes the same one; it is recorded in a checkpoint and checked against the model when one
is loaded, because a checkpoint's partitions only make sense under the plan that wrote them.

No RPC here: a plan, the tensor slicing it implies (a per-parameter gradient or parameter
list to one flat buffer per server, and back), and the module a server holds its pieces in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from psserver.utils.hashing import mix64

SPLIT_ABOVE = 1 << 20
"""Elements above which a parameter is always cut across the servers (4 MB in fp32: BytePS's
partition size)."""
SHARE_FRACTION = 16
"""A parameter above 1/16 of a server's share of the model is cut too, whatever its size: the
tensors packed whole are then small against each share, so the greedy packing keeps every
server within about 1/16 of a share of the mean (a model of a few large tensors, say an MLP of
two 1024-wide layers, would otherwise leave most of it on one or two servers)."""
PLAN_FORMAT = 1


@dataclass(frozen=True)
class Piece:
    """Elements ``[start, stop)`` of parameter ``param`` (flattened), held by server ``server``."""

    param: int
    start: int
    stop: int
    server: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class PartitionPlan:
    sizes: tuple[int, ...]
    """Elements of each parameter, in the model's order."""
    num_servers: int
    split_above: int
    pieces: tuple[Piece, ...]
    """Every element of every parameter exactly once, in the model's order."""

    def for_server(self, server: int) -> list[Piece]:
        """What ``server`` holds, in the model's order (the order of its flat buffer)."""
        return [p for p in self.pieces if p.server == server]

    def elements_per_server(self) -> list[int]:
        out = [0] * self.num_servers
        for p in self.pieces:
            out[p.server] += p.numel
        return out

    def split(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One flat buffer per server from one tensor per parameter (a gradient, say), each
        buffer the concatenation of the server's pieces in the model's order."""
        self._check(tensors)
        flats = [t.reshape(-1) for t in tensors]
        return [torch.cat([flats[p.param][p.start:p.stop] for p in self.for_server(s)])
                if self.for_server(s) else tensors[0].new_empty(0) for s in range(self.num_servers)]

    def gather(self, buffers: Sequence[torch.Tensor], like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The inverse of :meth:`split`: one tensor per parameter, shaped as ``like``."""
        if len(buffers) != self.num_servers:
            raise ValueError(f"{len(buffers)} buffers for {self.num_servers} servers")
        self._check(like)
        out = [torch.empty(t.numel(), dtype=buffers[0].dtype, device=buffers[0].device) for t in like]
        for s, buf in enumerate(buffers):
            offset = 0
            for p in self.for_server(s):
                out[p.param][p.start:p.stop] = buf[offset:offset + p.numel]
                offset += p.numel
            if offset != buf.numel():
                raise ValueError(f"buffer of server {s} holds {buf.numel()} elements, its pieces {offset}")
        return [o.view_as(t) for o, t in zip(out, like, strict=True)]

    def to_dict(self) -> dict:
        """What a checkpoint records (plain types only: it loads with ``weights_only=True``)."""
        return {"format": PLAN_FORMAT, "sizes": list(self.sizes), "num_servers": self.num_servers,
                "split_above": self.split_above, "pieces": [[p.param, p.start, p.stop, p.server] for p in self.pieces]}

    @classmethod
    def from_dict(cls, d: dict) -> PartitionPlan:
        """A recorded plan, checked whole (``ValueError`` for one that is not a plan)."""
        try:
            if d["format"] != PLAN_FORMAT:
                raise ValueError(f"partition plan format {d['format']!r}, expected {PLAN_FORMAT}")
            recorded = cls(tuple(int(n) for n in d["sizes"]), int(d["num_servers"]), int(d["split_above"]),
                           tuple(Piece(*(int(v) for v in p)) for p in d["pieces"]))
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a partition plan ({e!r})") from None
        if recorded != make_plan(recorded.sizes, recorded.num_servers, recorded.split_above):
            raise ValueError("the recorded partition plan is not the one its sizes and servers give")
        return recorded

    def check_model(self, sizes: Sequence[int]) -> None:
        """``ValueError`` unless this plan is for a model with these parameter sizes."""
        if tuple(sizes) != self.sizes:
            raise ValueError(f"the partition plan is for {len(self.sizes)} parameters of {sum(self.sizes)} elements, "
                             f"the model has {len(sizes)} of {sum(sizes)}")

    def _check(self, tensors: Sequence[torch.Tensor]) -> None:
        if tuple(t.numel() for t in tensors) != self.sizes:
            raise ValueError(f"{len(tensors)} tensors of {sum(t.numel() for t in tensors)} elements for a plan of "
                             f"{len(self.sizes)} parameters of {sum(self.sizes)}")


def make_plan(sizes: Sequence[int], num_servers: int, split_above: int = SPLIT_ABOVE) -> PartitionPlan:
    """The plan for parameters of ``sizes`` elements over ``num_servers`` servers."""
    if num_servers < 1:
        raise ValueError(f"--num-servers must be >= 1, got {num_servers}")
    if split_above < 1:
        raise ValueError(f"split bound must be >= 1 element, got {split_above}")
    if any(n < 0 for n in sizes):
        raise ValueError("parameter sizes must be >= 0")
    load = [0] * num_servers
    pieces: list[Piece] = []
    small: list[int] = []
    bound = min(split_above, max(1, sum(sizes) // (SHARE_FRACTION * num_servers)))
    for i, n in enumerate(sizes):
        if n > bound and num_servers > 1:
            base, extra = divmod(n, num_servers)
            start = 0
            for s in range(num_servers):
                stop = start + base + (1 if s < extra else 0)
                pieces.append(Piece(i, start, stop, s))
                load[s] += stop - start
                start = stop
        else:
            small.append(i)
    # Largest first onto the least-loaded server (ties: the lowest index): deterministic.
    for i in sorted(small, key=lambda i: (-sizes[i], i)):
        s = min(range(num_servers), key=lambda s: (load[s], s))
        pieces.append(Piece(i, 0, sizes[i], s))
        load[s] += sizes[i]
    pieces.sort(key=lambda p: (p.param, p.start))
    return PartitionPlan(tuple(sizes), num_servers, split_above, tuple(pieces))


def plan_for_model(model: nn.Module, num_servers: int, split_above: int = SPLIT_ABOVE) -> PartitionPlan:
    return make_plan([p.numel() for p in model.parameters()], num_servers, split_above)


class PartitionModule(nn.Module):
    """What one server holds: its pieces of the model's parameters, each a flat parameter (the
    optimizers psserver offers are element-wise, so a piece steps as the whole tensor would).
    It has no forward: a partition server only applies updates and serves parameters."""

    def __init__(self, model: nn.Module, plan: PartitionPlan, server: int) -> None:
        super().__init__()
        plan.check_model([p.numel() for p in model.parameters()])
        params = [p.detach().reshape(-1) for p in model.parameters()]
        self.pieces = nn.ParameterList(
            [nn.Parameter(params[p.param][p.start:p.stop].clone()) for p in plan.for_server(server)])

    @classmethod
    def from_flat(cls, plan: PartitionPlan, server: int, flat: torch.Tensor) -> PartitionModule:
        """The partition of ``server`` from its pieces as one flat buffer (what server 0 sends a
        server that holds no model: only its pieces, never the whole model)."""
        pieces = plan.for_server(server)
        if flat.dim() != 1 or flat.numel() != sum(p.numel for p in pieces) or not flat.is_floating_point():
            raise ValueError(f"{tuple(flat.shape)} {flat.dtype} values for a partition of "
                             f"{sum(p.numel for p in pieces)} parameter elements")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        sizes = [p.numel for p in pieces]
        module.pieces = nn.ParameterList([nn.Parameter(t.clone()) for t in flat.split(sizes)])
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a partition of the parameters has no forward (--compute server needs --num-servers 1)")


def owner(ids: torch.Tensor, num_servers: int) -> torch.Tensor:
    """The server process that holds each id's row (the same hash for every table)."""
    if num_servers == 1:
        return torch.zeros_like(ids)
    return (mix64(ids) & ((1 << 62) - 1)).remainder(num_servers)
