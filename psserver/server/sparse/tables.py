"""Every embedding table of the model on one server process, and how ids find their server.

Rows are spread over the server processes by a hash of the id (``owner``), so each server
holds about 1/S of every table and a trainer sends each server only the ids it owns: one
request per server per step, inside the step protocol's exchange. The server remembers the
ids it served a trainer for its open step (``served``), so the gradients of those rows come
back as a ``[n, dim]`` tensor per table and the ids cross the network once per step.

A row gradient rides in the step's gradient dict under a :class:`RowGrads` key, beside the
dense parameters: the gradient guard then counts it in the step's norm, drops it with a
non-finite step and clips it with the rest; the updater hands it to :meth:`SparseTables.apply`.
No RPC here: the step protocol calls it on the server's compute thread.
"""

from __future__ import annotations

import logging
import threading

import torch

from psserver.common.partition import owner
from psserver.config import EmbeddingConfig
from psserver.models import TableDef
from psserver.server.sparse.table import EmbeddingTable, RowChanges, TableSpec
from psserver.telemetry import TableStatus
from psserver.utils.hashing import mix64

log = logging.getLogger(__name__)

MAX_IDS_PER_REQUEST = 1 << 22
"""Ids of one table in one request at most: a bound on the work a caller can ask for."""


class RowGrads:
    """The key of one table's row gradients in a step's gradient dict (hashed by identity)."""

    __slots__ = ("ids", "table")

    def __init__(self, table: str, ids: torch.Tensor) -> None:
        self.table = table
        self.ids = ids

    def __repr__(self) -> str:
        return f"RowGrads({self.table!r}, {self.ids.numel()} ids)"


def _merged(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(unique ids, summed gradients) of several (ids, gradients) of one table."""
    if len(parts) == 1:
        return parts[0]
    ids, inverse = torch.unique(torch.cat([i for i, _ in parts]), return_inverse=True)
    grads = torch.cat([g for _, g in parts])
    return ids, torch.zeros(ids.numel(), grads.shape[1], dtype=grads.dtype).index_add_(0, inverse, grads)


class SparseTables:
    """The tables of one server process: lookups, row-wise updates, state, status."""

    def __init__(self, defs: tuple[TableDef, ...], config: EmbeddingConfig, default_dim: int, *, seed: int,
                 server_rank: int = 0, num_servers: int = 1) -> None:
        self.config = config
        self.dim = config.dim or default_dim
        self.server_rank = server_rank
        self.num_servers = num_servers
        self.tables: dict[str, EmbeddingTable] = {}
        for i, d in enumerate(defs):
            spec = TableSpec(d.name, self.dim + d.extra_dims, config.max_rows, config.eviction, config.ttl_steps,
                             config.admit_after, config.optimizer, config.lr, config.init_std,
                             seed=seed * 1_000_003 + i)
            self.tables[d.name] = EmbeddingTable(spec)
        self._lock = threading.RLock()  # the rows: protocols serve them on RPC or compute threads
        self._served_lock = threading.Lock()
        self._served: dict[str, dict[str, torch.Tensor]] = {}  # trainer -> the ids of its open step

    def describe(self) -> dict:
        """What a trainer needs to know of the tables (the join reply)."""
        return {"dim": self.dim, "tables": {n: t.spec.dim for n, t in self.tables.items()},
                "num_servers": self.num_servers}

    # ---- the step protocol's calls ------------------------------------------------------------

    def check_ids(self, request: object) -> dict[str, torch.Tensor]:
        """``request`` as ``{table: unique ids this server owns}``; ``ValueError`` for anything
        else (a caller's bytes never reach a table unchecked)."""
        if not isinstance(request, dict):
            raise ValueError(f"row request must map table names to ids, got {type(request).__name__}")
        out = {}
        for name, ids in request.items():
            if name not in self.tables:
                raise ValueError(f"no embedding table {name!r} (tables: {', '.join(self.tables)})")
            if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1:
                raise ValueError(f"ids of table {name!r} must be a 1-D int64 tensor")
            if ids.numel() > MAX_IDS_PER_REQUEST:
                raise ValueError(f"{ids.numel()} ids of table {name!r} in one request (at most {MAX_IDS_PER_REQUEST})")
            if ids.numel():
                if int(ids.min()) < 0:
                    raise ValueError(f"ids of table {name!r} must be >= 0")
                if torch.unique(ids).numel() != ids.numel():
                    raise ValueError(f"ids of table {name!r} must be unique in a request")
                if self.num_servers > 1 and bool((owner(ids, self.num_servers) != self.server_rank).any()):
                    raise ValueError(f"ids of table {name!r} sent to server {self.server_rank} that another server "
                                     "holds")
            out[name] = ids
        return out

    def serve(self, trainer: str, request: object) -> dict[str, torch.Tensor]:
        """The rows of a step ``trainer`` opens (created on first touch, admission allowing); the
        ids are remembered for the gradients it hands in with its next call."""
        ids = self.check_ids(request)
        with self._lock:
            rows = {name: self.tables[name].lookup(t, train=True) for name, t in ids.items()}
        with self._served_lock:
            self._served[trainer] = ids
        return rows

    def lookup(self, request: object) -> dict[str, torch.Tensor]:
        """Rows for evaluation: nothing is created or counted as a touch."""
        ids = self.check_ids(request)
        with self._lock:
            return {name: self.tables[name].lookup(t, train=False) for name, t in ids.items()}

    def changes_since(self, name: str, since: int) -> RowChanges:
        """A reader's delta of table ``name`` (``EmbeddingTable.changes_since``; ``ValueError``
        for an unknown table)."""
        table = self.tables.get(name)
        if table is None:
            raise ValueError(f"no table {name[:80]!r}; tables: {', '.join(sorted(self.tables))}")
        with self._lock:
            return table.changes_since(since)

    def row_grads(self, trainer: str, grads: object) -> dict[RowGrads, torch.Tensor]:
        """The row gradients of ``trainer``'s open step, keyed for its gradient dict (``ValueError``
        when they do not fit the rows it was served)."""
        with self._served_lock:
            served = self._served.pop(trainer, None)
        if not isinstance(grads, dict):
            raise ValueError(f"row gradients must map table names to tensors, got {type(grads).__name__}")
        if served is None:
            raise ValueError(f"{trainer} sent row gradients but was served no rows for its open step")
        if set(grads) != set(served):
            raise ValueError(f"row gradients for tables {sorted(grads)}, rows served for {sorted(served)}")
        out = {}
        for name, g in grads.items():
            ids = served[name]
            want = (ids.numel(), self.tables[name].spec.dim)
            if not isinstance(g, torch.Tensor) or not g.is_floating_point() or tuple(g.shape) != want:
                raise ValueError(f"row gradients of table {name!r} must be a float tensor of shape {want}")
            out[RowGrads(name, ids)] = g.to(torch.float32)
        return out

    def forget(self, trainer: str) -> None:
        """``trainer``'s open step is gone: so are the ids it was served."""
        with self._served_lock:
            self._served.pop(trainer, None)

    def apply(self, grads: dict, scale: float = 1.0) -> None:
        """One row-wise optimizer step per table from the :class:`RowGrads` entries of a step's
        gradient dict (the dense ones are the shards'), then the tables' clocks tick. A sync
        round holds several trainers' entries: the gradients of an id they share are summed
        into one step of its row, as for a dense parameter."""
        by_table: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for key, g in grads.items():
            if isinstance(key, RowGrads):
                by_table.setdefault(key.table, []).append((key.ids, g))
        with self._lock:
            for name, parts in by_table.items():
                self.tables[name].apply(*_merged(parts), scale)
            for table in self.tables.values():
                table.end_step()

    # ---- state ----------------------------------------------------------------------------------

    def prefill(self, rows: int) -> None:
        """Create ``rows`` rows in every table (ids this server owns, spread over a 2^40 space) as
        if trainers had touched them: benchmarks and tests of a server that holds many rows."""
        start = 0
        for table in self.tables.values():
            while table.num_rows < rows:
                n = min(1 << 20, rows - table.num_rows)
                ids = mix64(torch.arange(start, start + 4 * n, dtype=torch.int64)) & ((1 << 40) - 1)
                start += 4 * n
                ids = torch.unique(ids[owner(ids, self.num_servers) == self.server_rank])
                fresh = ids[table.index.find(ids) < 0][:n]
                table._create(fresh)  # noqa: SLF001 - the table's own first-touch path
            start = 0
        log.info("prefilled %d rows in each of %d table(s)", rows, len(self.tables))

    def state_dict(self) -> dict:
        with self._lock:
            return {"dim": self.dim, "tables": {n: t.state_dict() for n, t in self.tables.items()}}

    @property
    def lock(self) -> threading.RLock:
        """Held while the rows change (lookups create rows, updates write them)."""
        return self._lock

    def live_state(self) -> dict:
        """(``lock`` held) Every table's ``live_state``: the tensors themselves, not copies."""
        return {"dim": self.dim, "live": True, "tables": {n: t.live_state() for n, t in self.tables.items()}}

    def signature(self) -> tuple[int, ...]:
        """Changes when a table's tensors are replaced by larger ones."""
        return tuple(t.grown for t in self.tables.values())

    def load_state_dict(self, state: dict) -> None:
        """A checkpoint's tables, or ``live_state``'s (the slots that hold rows are taken)."""
        if state.get("live"):
            state = {"dim": state["dim"],
                     "tables": {n: EmbeddingTable.from_live_state(t) for n, t in state["tables"].items()}}
        if int(state["dim"]) != self.dim or set(state["tables"]) != set(self.tables):
            raise ValueError(f"the checkpoint's tables ({', '.join(state['tables'])}, dim {state['dim']}) are not "
                             f"this server's ({', '.join(self.tables)}, dim {self.dim})")
        with self._lock:
            for name, table in self.tables.items():
                table.load_state_dict(state["tables"][name])
        with self._served_lock:
            self._served.clear()

    def status(self) -> list[TableStatus]:
        out = []
        for name, t in self.tables.items():
            c = t.counters
            out.append(TableStatus(table=name, server_rank=self.server_rank, rows=t.num_rows,
                                   max_rows=t.spec.max_rows, dim=t.spec.dim, bytes=t.nbytes(), admissions=c.created,
                                   refused=c.admissions_refused, evictions=c.evicted, expirations=c.expired,
                                   lookups=c.lookups, updates=c.updates))
        return out
