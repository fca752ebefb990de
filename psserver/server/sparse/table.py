"""One embedding table's rows on one server: created on first touch, admitted after N sightings,
evicted past a bound (LRU or LFU) or a time-to-live, updated row-wise.

No RPC here and no dense table: the rows that exist sit in slots of growing tensors, found
through an :class:`~psserver.server.sparse.index.IdIndex`. A row's initial values are a pure
function of the table's seed and its id, so a row evicted and created again, or created on
another server, starts the same way. An id not admitted yet reads the table's shared default
row (zeros) and its gradient is dropped, as Monolith, PERSIA and DeepRec do for rare ids;
sightings are counted in a count-min sketch of fixed size, so ids that never make it cost no
memory per id.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass

import torch

from psserver.server.sparse.index import IdIndex
from psserver.utils.hashing import mix64, normal_by_id

log = logging.getLogger(__name__)

EVICTION_POLICIES = ("lru", "lfu")
ROW_OPTIMIZERS = ("rowwise_adagrad", "lazy_adam")
_SKETCH_DEPTH = 4


@dataclass(frozen=True)
class TableSpec:
    """What a server needs to hold one table (built from the server's embedding config)."""

    name: str
    dim: int
    max_rows: int
    """Rows this server keeps at most; past it the least recently (``lru``) or least often
    (``lfu``) touched go, in batches down to 95 %."""
    eviction: str = "lru"
    ttl_steps: int = 0
    """Rows untouched for this many steps are evicted (0: never)."""
    admit_after: int = 1
    """An id becomes a row the Nth time a training batch holds it (1: at once)."""
    optimizer: str = "rowwise_adagrad"
    lr: float = 0.05
    init_std: float = 0.01
    seed: int = 0
    sketch_width: int = 1 << 20
    """Counters per row of the admission sketch (4 rows of int32: 16 MB)."""

    def __post_init__(self) -> None:
        if self.dim < 1 or self.max_rows < 1:
            raise ValueError("embedding dim and max rows must be >= 1")
        if self.eviction not in EVICTION_POLICIES:
            raise ValueError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, got {self.eviction!r}")
        if self.optimizer not in ROW_OPTIMIZERS:
            raise ValueError(f"row optimizer must be one of {', '.join(ROW_OPTIMIZERS)}, got {self.optimizer!r}")
        if self.ttl_steps < 0 or self.admit_after < 1:
            raise ValueError("ttl must be >= 0 steps and admission >= 1 sighting")
        if not (self.lr > 0 and self.init_std >= 0):
            raise ValueError("lr must be > 0 and init std >= 0")


@dataclass
class TableCounters:
    rows: int = 0
    created: int = 0
    admissions_refused: int = 0
    """Lookups of ids not admitted yet (they read the default row)."""
    evicted: int = 0
    expired: int = 0
    lookups: int = 0
    updates: int = 0


MAX_DROPS_KEPT = 1 << 20
"""Dropped ids kept for readers' deltas (8 MB); a reader further behind starts over."""


@dataclass(frozen=True)
class RowChanges:
    """A reader's delta of one table (:meth:`EmbeddingTable.changes_since`)."""

    step: int
    """The table's clock now: the next delta is asked from it."""
    full: bool
    """Every row is here: the reader drops what it held first."""
    ids: torch.Tensor
    rows: torch.Tensor
    gone: torch.Tensor


class EmbeddingTable:
    """The rows of one table held by one server."""

    BETAS = (0.9, 0.999)
    EPS = 1e-8

    def __init__(self, spec: TableSpec, initial_capacity: int = 1024) -> None:
        self.spec = spec
        self.index = IdIndex(initial_capacity * 2)
        cap = max(16, initial_capacity)
        self.ids = torch.full((cap,), -1, dtype=torch.int64)
        self.weights = torch.zeros(cap, spec.dim)
        self.last_step = torch.zeros(cap, dtype=torch.int64)
        self.hits = torch.zeros(cap, dtype=torch.int64)
        self.changed = torch.zeros(cap, dtype=torch.int64)
        """The clock at which each slot's row was last written (created or stepped), for readers'
        deltas (:meth:`changes_since`); kept in this process only (a restore marks every row)."""
        self.state = self._new_state(cap)
        self._free: list[int] = list(range(cap - 1, -1, -1))
        self.sketch = torch.zeros(_SKETCH_DEPTH, spec.sketch_width, dtype=torch.int32) if spec.admit_after > 1 \
            else None
        self.step = 0
        self.clock = torch.zeros(1, dtype=torch.int64)
        """``step``, where a memory-mapped copy of the table's tensors can see it."""
        self.grown = 0
        """Times the slot tensors were replaced by larger ones (their set of tensors changed)."""
        self.counters = TableCounters()
        self.default = torch.zeros(spec.dim)
        self._dropped: collections.deque[tuple[int, torch.Tensor]] = collections.deque()
        """(clock, ids) of the rows dropped (evicted, expired) since ``_dropped_from``."""
        self._dropped_ids = 0
        self._dropped_from = -1
        """The clock after which every dropped row is in ``_dropped``: a reader's delta from before
        it starts over (``full``)."""

    # ---- reads and writes ---------------------------------------------------------------

    def lookup(self, ids: torch.Tensor, *, train: bool = True) -> torch.Tensor:
        """The rows of ``ids`` (unique, int64), ``[n, dim]``. In training an id seen often
        enough becomes a row (created from its initial values); the others read the default."""
        ids = ids.to(torch.int64)
        slots = self.index.find(ids)
        absent = slots < 0
        if train and bool(absent.any()):
            new = ids[absent]
            if self.sketch is not None:
                admitted = self._count(new) >= self.spec.admit_after
                self.counters.admissions_refused += int((~admitted).sum())
                new = new[admitted]
            if new.numel():
                created = self._create(new)
                slots[absent.nonzero().squeeze(1)[torch.isin(ids[absent], new)]] = created
        out = self.default.expand(ids.numel(), -1).clone()
        have = slots >= 0
        out[have] = self.weights[slots[have]]
        if train:
            self.last_step[slots[have]] = self.step
            self.hits[slots[have]] += 1
        self.counters.lookups += ids.numel()
        return out

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, scale: float = 1.0) -> None:
        """One row-wise optimizer step for the rows of ``ids`` (unique); ids without a row
        (not admitted, or evicted since their lookup) are skipped."""
        ids = ids.to(torch.int64)
        if grads.shape != (ids.numel(), self.spec.dim):
            raise ValueError(f"row gradients of shape {tuple(grads.shape)} for {ids.numel()} ids of dim "
                             f"{self.spec.dim}")
        slots = self.index.find(ids)
        have = slots >= 0
        slots, g = slots[have], grads[have].to(torch.float32) * scale
        if not slots.numel():
            return
        lr = self.spec.lr
        if self.spec.optimizer == "rowwise_adagrad":
            acc = self.state["sum"]
            acc[slots] += g.pow(2).mean(1)
            self.weights[slots] -= lr * g / (acc[slots].sqrt() + 1e-10).unsqueeze(1)
        else:  # lazy Adam: moments and bias correction per row, only for the rows touched
            b1, b2 = self.BETAS
            m, v, t = self.state["m"], self.state["v"], self.state["t"]
            t[slots] += 1
            m[slots] = b1 * m[slots] + (1 - b1) * g
            v[slots] = b2 * v[slots] + (1 - b2) * g * g
            steps = t[slots].to(torch.float32).unsqueeze(1)
            m_hat = m[slots] / (1 - b1 ** steps)
            v_hat = v[slots] / (1 - b2 ** steps)
            self.weights[slots] -= lr * m_hat / (v_hat.sqrt() + self.EPS)
        self.changed[slots] = self.step + 1
        self.counters.updates += int(slots.numel())

    def end_step(self) -> None:
        """A step of the job ended: the clock of LRU and of the time-to-live ticks; expired rows go."""
        self.step += 1
        self.clock[0] = self.step
        ttl = self.spec.ttl_steps
        if ttl and self.step % max(1, ttl // 4) == 0:
            live = self.ids >= 0
            old = live & (self.last_step < self.step - ttl)
            if bool(old.any()):
                slots = old.nonzero().squeeze(1)
                self._drop(slots)
                self.counters.expired += int(slots.numel())

    # ---- rows ------------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return self.index.size

    def nbytes(self) -> int:
        per_slot = self.weights[0].numel() * 4 + 16 + sum(t[0].numel() * t.element_size() for t in self.state.values())
        return self.ids.numel() * per_slot + self.index.nbytes() + (self.sketch.numel() * 4 if self.sketch is not None
                                                                     else 0)

    def changes_since(self, since: int) -> RowChanges:
        """What a reader holding the rows as of clock ``since`` (-1: none) needs to hold them as
        now: the rows written after it (created or stepped) and the ids dropped after it (they
        read the default row again; one dropped and created again is in both: drop first). From
        before what the drop log keeps, or before a restore, every row (``full``: start over)."""
        full = since < 0 or since < self._dropped_from
        if full:
            since = -1
        chosen = (self.ids >= 0) & (self.changed > since)
        gone = [ids for step, ids in self._dropped if step > since] if not full else []
        # A boolean mask's indexing copies: the rows taken under the lock, once.
        return RowChanges(self.step, full, self.ids[chosen], self.weights[chosen],
                          torch.cat(gone) if gone else torch.zeros(0, dtype=torch.int64))

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Each id's initial row, N(0, init_std) from a hash of (seed, id, column): the same on
        every server and every time the row is created."""
        return normal_by_id(ids, self.spec.dim, self.spec.seed) * self.spec.init_std

    def _create(self, ids: torch.Tensor) -> torch.Tensor:
        overflow = self.num_rows + ids.numel() - self.spec.max_rows
        if overflow > 0:
            self._evict(max(overflow, self.num_rows + ids.numel() - int(0.95 * self.spec.max_rows)))
        slots = self._take_slots(ids.numel())
        self.weights[slots] = self.initial_rows(ids)
        self.changed[slots] = self.step + 1
        self.last_step[slots] = self.step
        self.hits[slots] = 0
        for t in self.state.values():
            t[slots] = 0
        # Last: a slot holds a row once its id is written (a process killed before that left a
        # free slot, see from_live_state).
        self.ids[slots] = ids
        self.index.insert(ids, slots)
        self.counters.created += ids.numel()
        return slots

    def _evict(self, n: int) -> None:
        live = (self.ids >= 0).nonzero().squeeze(1)
        n = min(n, live.numel())
        if n <= 0:
            return
        score = self.last_step[live] if self.spec.eviction == "lru" else self.hits[live]
        victims = live[torch.topk(score, n, largest=False).indices]
        self._drop(victims)
        self.counters.evicted += n

    def _drop(self, slots: torch.Tensor) -> None:
        self._dropped.append((self.step + 1, self.ids[slots].clone()))
        self._dropped_ids += int(slots.numel())
        while self._dropped_ids > MAX_DROPS_KEPT and len(self._dropped) > 1:
            step, ids = self._dropped.popleft()
            self._dropped_ids -= ids.numel()
            self._dropped_from = step
        self.index.remove(self.ids[slots])
        self.ids[slots] = -1  # the slot is free from here (see from_live_state)
        self._free.extend(slots.tolist())

    def _take_slots(self, n: int) -> torch.Tensor:
        if len(self._free) < n:
            self._grow(self.ids.numel() + n)
        taken = [self._free.pop() for _ in range(n)]
        return torch.tensor(taken, dtype=torch.int64)

    def _grow(self, need: int) -> None:
        old = self.ids.numel()
        cap = old
        while cap < need:
            cap *= 2
        extra = cap - old
        self.ids = torch.cat([self.ids, torch.full((extra,), -1, dtype=torch.int64)])
        self.weights = torch.cat([self.weights, torch.zeros(extra, self.spec.dim)])
        self.last_step = torch.cat([self.last_step, torch.zeros(extra, dtype=torch.int64)])
        self.changed = torch.cat([self.changed, torch.zeros(extra, dtype=torch.int64)])
        self.hits = torch.cat([self.hits, torch.zeros(extra, dtype=torch.int64)])
        grown = self._new_state(extra)
        self.state = {k: torch.cat([v, grown[k]]) for k, v in self.state.items()}
        self._free[:0] = range(cap - 1, old - 1, -1)
        self.grown += 1

    def _new_state(self, n: int) -> dict[str, torch.Tensor]:
        if self.spec.optimizer == "rowwise_adagrad":
            return {"sum": torch.zeros(n)}
        return {"m": torch.zeros(n, self.spec.dim), "v": torch.zeros(n, self.spec.dim),
                "t": torch.zeros(n, dtype=torch.int64)}

    def _count(self, ids: torch.Tensor) -> torch.Tensor:
        """Count one more sighting of each id (count-min sketch); the counts after it."""
        assert self.sketch is not None
        width = self.sketch.shape[1]
        counts = []
        for d in range(_SKETCH_DEPTH):
            col = mix64(ids * (2 * d + 3) + d) & (width - 1) if width & (width - 1) == 0 else \
                mix64(ids * (2 * d + 3) + d).remainder(width)
            row = self.sketch[d]
            row.index_add_(0, col, torch.ones_like(col, dtype=torch.int32))
            counts.append(row[col])
        return torch.stack(counts).min(0).values

    # ---- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Every existing row with its optimizer state and clocks (CPU copies)."""
        live = (self.ids >= 0).nonzero().squeeze(1)
        return {"ids": self.ids[live].clone(), "weights": self.weights[live].clone(),
                "last_step": self.last_step[live].clone(), "hits": self.hits[live].clone(),
                "state": {k: v[live].clone() for k, v in self.state.items()}, "step": self.step,
                "sketch": None if self.sketch is None else self.sketch.clone(),
                "counters": dict(vars(self.counters))}

    def live_state(self) -> dict:
        """The tensors every lookup and update writes to, every slot (free ones hold id -1): what
        a memory-mapped copy of the table keeps (``psserver.server.state.memory``). The id
        index is not among them: it follows from ``ids``."""
        return {"ids": self.ids, "weights": self.weights, "last_step": self.last_step, "hits": self.hits,
                "state": dict(self.state), "clock": self.clock, "sketch": self.sketch}

    @staticmethod
    def from_live_state(live: dict) -> dict:
        """``live_state``'s tensors as ``state_dict`` gives them: the slots that hold a row."""
        rows = (live["ids"] >= 0).nonzero().squeeze(1)
        return {"ids": live["ids"][rows], "weights": live["weights"][rows], "last_step": live["last_step"][rows],
                "hits": live["hits"][rows], "state": {k: v[rows] for k, v in live["state"].items()},
                "step": int(live["clock"][0]), "sketch": live["sketch"], "counters": {}}

    def load_state_dict(self, state: dict) -> None:
        n = int(state["ids"].numel())
        fresh = EmbeddingTable(self.spec, initial_capacity=max(16, n))
        if n:
            slots = fresh._take_slots(n)
            fresh.ids[slots] = state["ids"]
            fresh.weights[slots] = state["weights"]
            fresh.last_step[slots] = state["last_step"]
            fresh.hits[slots] = state["hits"]
            for k, v in state["state"].items():
                fresh.state[k][slots] = v
            fresh.index.insert(state["ids"], slots)
        self.__dict__.update(fresh.__dict__)
        self.step = int(state["step"])
        self.clock[0] = self.step
        # What readers held of the rows before is not known here: every row counts as written
        # now, and a delta from before now starts over.
        self.changed[self.ids >= 0] = self.step
        self._dropped_from = self.step
        if state.get("sketch") is not None:
            self.sketch = state["sketch"].clone()
        self.counters = TableCounters(**state.get("counters", {}))
        self.counters.rows = self.num_rows

