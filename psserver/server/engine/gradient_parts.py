"""A trainer's flat gradient, assembled from the buckets it sent while its backward ran.

A ``--step pushpull`` trainer sends each large bucket of its gradient (``psserver.trainer.compute.buckets``)
as soon as backward has filled it, as DDP's reducer starts a bucket's all-reduce, and the call
that ends the step carries what is left. The server copies each part into its place in one
buffer per shard, allocated once per trainer and reused, and takes the buffers when the step's
call comes, once the parts tile every shard exactly. Parts carry the step's number: parts of a
step that never got its call (it failed) are overwritten by the next step's, and a step's parts
are used once (a step sent again sends all its parts again).

On a GPU the parts arrive on the RPC's streams and the update reads them on the shard's: each
part is copied into place on the shard's own stream (``Shard.run``), after the stream it came on
and after the update that read the buffers last (that stream's earlier work), and the step's
call orders its own stream after those copies before the update takes the buffers; no wait of
the device, nor of the caller.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from psserver.common.tensors import Part
from psserver.server.engine.shard import Shard


class GradientParts:
    """The parts of one trainer's gradient, one buffer per shard of ``numels`` values in
    ``dtype`` on ``devices`` (the shards')."""

    def __init__(self, numels: Sequence[int], dtype: torch.dtype, devices: Sequence[torch.device],
                 shards: Sequence[Shard] | None = None) -> None:
        """``shards``: the server's, whose streams order the copies on a GPU (None: the caller's stream)."""
        self.numels = list(numels)
        self.dtype = dtype
        self._devices = list(devices)
        self._shards = list(shards) if shards is not None else None
        self._flats: list[torch.Tensor] | None = None  # allocated by the first part
        self._lock = threading.Lock()
        self.number: int | None = None
        """The step whose parts the buffers hold."""
        self._ranges: list[list[tuple[int, int]]] = [[] for _ in self.numels]

    def put(self, number: int, parts: Sequence[Part]) -> None:
        """Copy ``parts`` of step ``number`` into place (``ValueError`` for one that does not fit;
        nothing is kept of a call that had one)."""
        checked = [self._check(p) for p in parts]
        with self._lock:
            if self._flats is None:
                self._flats = [self._run(i, lambda n=n, d=d: torch.empty(n, dtype=self.dtype, device=d))
                               for i, (n, d) in enumerate(zip(self.numels, self._devices, strict=True))]
            if number != self.number:  # a new step: what an earlier one left is overwritten
                self.number = number
                self._ranges = [[] for _ in self.numels]
            with torch.no_grad():
                for shard, start, values in checked:
                    flat = self._flats[shard]
                    self._run(shard, lambda f=flat, a=start, v=values: f[a:a + v.numel()].copy_(v), values)
                    self._ranges[shard].append((start, start + values.numel()))

    def _run(self, shard: int, work, *received: torch.Tensor):
        """``work()`` on shard ``shard``'s stream (``Shard.run``), else as it is."""
        return work() if self._shards is None else self._shards[shard].run(work, *received)

    def _check(self, part: object) -> Part:
        if not isinstance(part, tuple) or len(part) != 3:
            raise ValueError("a gradient part is (shard, start, values)")
        shard, start, values = part
        if not isinstance(shard, int) or isinstance(shard, bool) or not 0 <= shard < len(self.numels):
            raise ValueError(f"a gradient part of shard {shard!r}; the model has {len(self.numels)}")
        if not isinstance(values, torch.Tensor) or values.dim() != 1 or not values.is_floating_point() \
                or values.layout != torch.strided or values.is_meta or values.is_quantized:
            raise ValueError("a gradient part's values are one 1-D floating tensor")
        if not isinstance(start, int) or isinstance(start, bool) or start < 0 \
                or start + values.numel() > self.numels[shard]:
            raise ValueError(f"a gradient part at {start!r}+{values.numel()} outside shard {shard}'s "
                             f"{self.numels[shard]} values")
        return shard, start, values

    def finish(self, number: int, parts: Sequence[Part]) -> list[torch.Tensor]:
        """The step's call: its last ``parts``, then the whole gradient (:meth:`take`)."""
        self.put(number, parts)
        return self.take(number)

    def take(self, number: int) -> list[torch.Tensor]:
        """The whole gradient of step ``number``, one buffer per shard (``ValueError`` unless its
        parts cover every value of every shard once). The buffers are reused by the next step's
        parts: the caller is done with them before it answers the call."""
        with self._lock:
            if self.number != number or self._flats is None:
                raise ValueError(f"no parts of step {number} arrived (last: {self.number})")
            ranges, self.number, self._ranges = self._ranges, None, [[] for _ in self.numels]
            for shard, taken in enumerate(ranges):  # taken or refused, a step's parts are used once
                end = 0
                for start, stop in sorted(taken):
                    if start != end:
                        break
                    end = stop
                if end != self.numels[shard] or sum(b - a for a, b in taken) != self.numels[shard]:
                    raise ValueError(f"the parts of step {number} do not cover shard {shard} once")
            for shard in self._shards or ():  # the caller reads them after the copies into them
                shard.after_updates()
            return list(self._flats)
