"""An id -> slot hash index over int64 ids, vectorized with torch (the embedding tables').

Embedding ids live in a space as large as 2^63, of which a table holds the rows that were
touched: a dense array over the id space is out of the question, and a Python dict costs
about 100 bytes per row (a gigabyte at 10^7 rows). This is open addressing with linear
probing in two int64 tensors (16 bytes per slot, at most half full), where every operation
takes a whole batch of ids at once: one probe step for all of them per loop iteration, a few
iterations at this load. Ids are >= 0; -1 marks an empty slot, -2 a deleted one.
"""

from __future__ import annotations

import torch

from psserver.utils.hashing import mix64

EMPTY, DELETED = -1, -2
_MAX_LOAD = 0.5
class IdIndex:
    """Maps unique int64 ids to int64 values (row slots); batch operations only."""

    def __init__(self, capacity: int = 1024) -> None:
        cap = 1
        while cap < max(16, capacity):
            cap *= 2
        self._keys = torch.full((cap,), EMPTY, dtype=torch.int64)
        self._vals = torch.full((cap,), -1, dtype=torch.int64)
        self.size = 0
        self._deleted = 0

    @property
    def capacity(self) -> int:
        return self._keys.numel()

    def nbytes(self) -> int:
        return self._keys.numel() * 16

    def _home(self, ids: torch.Tensor) -> torch.Tensor:
        return mix64(ids) & (self.capacity - 1)

    def _locate(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(which of ``ids`` are present, their slots): one probe step for all per iteration."""
        which, slots = [], []
        active = torch.arange(ids.numel())
        pos = self._home(ids)
        mask = self.capacity - 1
        while active.numel():
            keys = self._keys[pos]
            hit = keys == ids[active]
            which.append(active[hit])
            slots.append(pos[hit])
            go_on = ~(hit | (keys == EMPTY))
            active, pos = active[go_on], (pos[go_on] + 1) & mask
        return torch.cat(which) if which else active, torch.cat(slots) if slots else active

    def find(self, ids: torch.Tensor) -> torch.Tensor:
        """The value of each id, -1 where it is absent."""
        ids = ids.to(torch.int64)
        out = torch.full_like(ids, -1)
        which, slots = self._locate(ids)
        out[which] = self._vals[slots]
        return out

    def insert(self, ids: torch.Tensor, values: torch.Tensor) -> None:
        """Add ``ids`` (unique, none present) with ``values``."""
        ids, values = ids.to(torch.int64), values.to(torch.int64)
        if not ids.numel():
            return
        if (self.size + self._deleted + ids.numel()) > _MAX_LOAD * self.capacity:
            self._rehash(self.size + ids.numel())
        mask = self.capacity - 1
        pos = self._home(ids)
        while ids.numel():
            keys = self._keys[pos]
            free = (keys == EMPTY) | (keys == DELETED)
            # Of several ids probing one free slot in this step, the first takes it (work in the
            # ids probing, not in the capacity).
            cand = free.nonzero().squeeze(1)
            slots, inverse = torch.unique(pos[cand], return_inverse=True)
            first = torch.full((slots.numel(),), ids.numel(), dtype=torch.int64)
            first.scatter_reduce_(0, inverse, cand, reduce="amin")
            won = torch.zeros(ids.numel(), dtype=torch.bool)
            won[first] = True
            self._deleted -= int((keys[won] == DELETED).sum())
            self._keys[pos[won]] = ids[won]
            self._vals[pos[won]] = values[won]
            self.size += int(won.sum())
            ids, values, pos = ids[~won], values[~won], (pos[~won] + 1) & mask

    def remove(self, ids: torch.Tensor) -> None:
        """Drop ``ids`` (absent ones are ignored)."""
        _, slots = self._locate(ids.to(torch.int64))
        self._keys[slots] = DELETED
        self._vals[slots] = -1
        self.size -= slots.numel()
        self._deleted += slots.numel()

    def items(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every (id, value), in slot order."""
        live = self._keys >= 0
        return self._keys[live].clone(), self._vals[live].clone()

    def _rehash(self, need: int) -> None:
        ids, values = self.items()
        cap = self.capacity
        while need > _MAX_LOAD * cap / 1.5:
            cap *= 2
        self._keys = torch.full((cap,), EMPTY, dtype=torch.int64)
        self._vals = torch.full((cap,), -1, dtype=torch.int64)
        self.size = self._deleted = 0
        self.insert(ids, values)
